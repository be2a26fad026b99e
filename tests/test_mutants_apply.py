"""Every mutant of benchmarks.mutation still applies to the current kernel source.

CI replays a rotating subset of the mutants (docs/MUTATION.md); one whose text no
longer matches exactly once would fail only the CI run that draws it. This checks
them all, in a second, on every run.
"""

from pathlib import Path

import pytest

from benchmarks.mutation import MUTANTS, check_applies


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_mutant_applies(mutant):
  check_applies(mutant, Path(__file__).parent.parent)


def test_mutants_are_distinct():
  """Two mutants making the same change to the same text test the same thing
  twice (M15 and M18 did, once forward and dq came to share their BlockSpecs)."""
  changes = [(m.file, m.old, m.new, m.occurrence or 0) for m in MUTANTS]
  assert len(set(changes)) == len(changes)


def test_a_mutant_copy_carries_the_precision_baseline(tmp_path):
  """A mutant that only makes the errors grow (S3) is killed by the baseline
  verdict (properties/judge/gates.py), which runs only where the mutant's copy has
  the checkout's baseline for this jax (docs/baselines/)."""
  import jax

  from benchmarks.mutation import _baseline_args, _copy_repo
  root = Path(__file__).resolve().parents[1]
  if not (root / "docs" / "baselines" / f"ua_kernels-ci-jax{jax.__version__}.json").is_file():
    pytest.skip(f"no committed baseline for jax {jax.__version__}")
  _copy_repo(root, tmp_path)
  [arg] = _baseline_args(tmp_path)
  assert arg == f"--ua-baseline={tmp_path}/docs/baselines/ua_kernels-ci-jax{jax.__version__}.json"
  assert Path(arg.split("=", 1)[1]).is_file()


def test_each_first_test_names_a_test_of_the_suite():
  """A mutant's first test (FIRST_TESTS) must be a test the black-box suite has
  (a regression case file, a property test of the ci profile): a stale name is
  a pytest usage error or no test, not a kill: the whole suite then runs
  after it, and the hint only costs a pytest start, silently."""
  from properties.model import profiles
  from benchmarks.mutation import FIRST_TESTS
  from properties.campaign.schedule import property_tests

  root = Path(__file__).parent.parent
  cases = {p.stem for p in (root / "tests" / "regressions").glob("*.json")}
  props = {t.id for t in property_tests(profiles.PROFILES["ci"])}
  assert set(FIRST_TESTS) <= {m.id for m in MUTANTS}
  for mutant, node in FIRST_TESTS.items():
    path, test = node.split("::")
    name = test[test.index("[") + 1:-1]
    assert (root / path).is_file(), (mutant, node)
    assert name in (cases if path.endswith("test_regressions.py") else props), (mutant, node)
