"""One judged case, one harness: the verifier builds the Harness (the float64
oracle, the same-precision reference, the bounds) of the case a property
judges once, hands it to the check, and builds none for a check that takes
none; nothing computes it a second time behind the check's back."""

import dataclasses

import pytest

from properties.checks import checks
from properties.checks.registry import Property, get
from properties.judge import runner
from properties.judge.runner import Harness, evaluate
from properties.model.case import Case
from properties.run.verifier import Verifier

SMALL = Case(batch=1, seq_len=9, num_q_heads=2, num_kv_heads=1, head_dim=16, dtype="float32",
             causal=True, return_lse=True, seed=11)


@pytest.fixture
def builds(monkeypatch):
  """The cases whose harness was built, and the oracle's evaluations, as they happen."""
  built, oracles = [], []
  of, reference = Harness.of.__func__, runner._reference

  def counting_of(cls, case):
    built.append(case)
    return of(cls, case)

  def counting_reference(case, inputs, float64):
    if float64:
      oracles.append(case)
    return reference(case, inputs, float64)

  monkeypatch.setattr(Harness, "of", classmethod(counting_of))
  monkeypatch.setattr(runner, "_reference", counting_reference)
  return built, oracles


def _check(prop, case, tmp_path):
  records = []
  errors = Verifier(runner.REFERENCE, str(tmp_path), record=records.append).check(prop, case)
  assert errors and all(e.ok for e in errors)
  return records[0]


def test_a_judged_case_builds_its_harness_once(builds, tmp_path):
  record = _check(get("matches_oracle"), SMALL, tmp_path)
  assert builds == ([SMALL], [SMALL])
  assert record["harness_seconds"] > 0


def test_a_derived_case_is_judged_by_its_own_harness_alone(builds, tmp_path):
  """unit_temperature_is_none scores against its no-temperature case: that
  case's harness is built, once, and the drawn case's never."""
  case = Case(batch=1, seq_len=9, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="float32", temperature="uniform", seed=4)
  _check(get("unit_temperature_is_none"), case, tmp_path)
  plain = checks.without_temperature(case)
  assert plain != case and builds == ([plain], [plain])


@pytest.mark.parametrize("name", ["deterministic", "hidden_keys_do_not_leak"])
def test_a_check_that_takes_no_harness_gets_none_built(builds, tmp_path, name):
  record = _check(get(name), SMALL, tmp_path)
  assert builds == ([], []) and record["harness_seconds"] == 0


def test_a_check_of_the_plain_form_runs_as_before(builds, tmp_path):
  """A property whose check takes (impl, case) alone is called so; the harness
  it scores against is its own, built once, by itself."""
  def plain(impl, case):
    return Harness.of(case).score(evaluate(impl, case))

  prop = Property("plain", plain, 1)
  assert not prop.takes_harness and get("matches_oracle").takes_harness
  record = _check(prop, SMALL, tmp_path)
  assert builds == ([SMALL], [SMALL]) and record["harness_seconds"] == 0


def test_a_harness_of_another_case_is_refused():
  with pytest.raises(ValueError, match="judged"):
    checks.matches_oracle(runner.REFERENCE, SMALL, Harness.of(dataclasses.replace(SMALL, seed=12)))
