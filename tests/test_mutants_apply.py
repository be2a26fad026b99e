"""Every mutant of ua-mutate still applies to the current kernel source.

CI replays a rotating subset of the mutants (docs/MUTATION.md); one whose text no
longer matches exactly once would fail only the CI run that draws it. This checks
them all, in a second, on every run.
"""

from pathlib import Path

import pytest

from properties.mutation import MUTANTS, check_applies


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_mutant_applies(mutant):
  check_applies(mutant, Path(__file__).parent.parent)


def test_mutants_are_distinct():
  """Two mutants making the same change to the same text test the same thing
  twice (M15 and M18 did, once forward and dq came to share their BlockSpecs)."""
  changes = [(m.file, m.old, m.new, m.occurrence or 0) for m in MUTANTS]
  assert len(set(changes)) == len(changes)
