"""ua-repro CASE --minimize (properties/campaign/minimize.py).

End to end: a planted defect (the reference with dk 1.5 times too large on causal
sequences longer than 16, tests/outside_kernels.py), a deliberately large
failing case written with the project's own writer, the minimizer through the
CLI entry point, and the minimal case file replayed by plain ua-repro. Then the
search itself against a fake verifier (no jax), for what it must reject."""

import dataclasses
import json
from pathlib import Path

import pytest

from properties import cli

from properties.campaign import minimize
from properties.model.capabilities import declare
from properties.model.case import Case, load_case_file, write_case_file
from properties.checks.checks import PropertyFailure
from properties.checks.registry import get
from properties.judge.tolerance import OutputError
from properties.run.verifier import CaseFailure, HarnessFailure

PLANTED = "outside_kernels:dk_off_when_causal_attention"
BIG = Case(batch=2, seq_len=200, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype="float32",
           causal=True, return_lse=True, distribution="large", seed=3)


@pytest.fixture
def outside(monkeypatch):
  monkeypatch.syspath_prepend(str(Path(__file__).parent))


def test_minimize_a_planted_defect_end_to_end(outside, tmp_path, capsys):
  path = tmp_path / "matches_oracle-big.json"
  write_case_file(path, BIG, "matches_oracle", PLANTED, status="failed")

  assert cli.repro_main([str(path), "--minimize"]) == 1
  out = capsys.readouterr().out
  assert "original: matches_oracle fails on ['dk']" in out
  assert "accepted" in out and "rejected" in out and "stopped: fixpoint" in out

  small_path = tmp_path / "matches_oracle-big.min.json"
  assert small_path.is_file()
  assert f"replay: ua-repro {small_path} --impl {PLANTED}" in out
  payload = load_case_file(small_path)
  small = payload["case"]
  assert payload["property"] == "matches_oracle" and payload["impl"] == PLANTED
  assert minimize.cost(small) * 4 <= minimize.cost(BIG)
  # The defect needs causal and T > 16: those stay; the rest goes.
  assert (small.seq_len, small.batch, small.num_q_heads, small.head_dim) == (17, 1, 1, 16)
  assert small.causal and not small.return_lse
  assert small.distribution == "normal"
  assert {e["name"] for e in json.loads(small_path.read_text())["errors"]
          if e["ratio"] > 1} == {"dk"}

  # Plain ua-repro replays the file: the same property, dk alone out of tolerance.
  assert cli.repro_main([str(small_path)]) == 1
  replayed = capsys.readouterr().out
  assert "FAIL: reproduces" in replayed
  assert "differs from the float64 oracle: dk out of tolerance" in replayed


def test_a_case_that_passes_is_not_minimized(outside, tmp_path, capsys):
  path = tmp_path / "c.json"
  write_case_file(path, dataclasses.replace(BIG, seq_len=7, batch=1, num_q_heads=1,
                                            num_kv_heads=1, head_dim=16),
                  "matches_oracle", PLANTED, status="failed")
  assert cli.repro_main([str(path), "--minimize"]) == 0
  assert "nothing to minimize" in capsys.readouterr().out
  assert not (tmp_path / "c.min.json").exists()


def test_a_case_outside_the_declarations_is_not_minimized(outside, tmp_path, capsys):
  """Every candidate would be outside them too: say so rather than run nothing."""
  path = tmp_path / "c.json"
  write_case_file(path, dataclasses.replace(BIG, cap_method="tanh", cap_params=(2.0,)),
                  "matches_oracle", "outside_kernels:window_bug_attention", status="failed")
  assert cli.repro_main([str(path), "--minimize"]) == 2
  assert "declares ['cap', 'lse'] unsupported" in capsys.readouterr().out
  assert not (tmp_path / "c.min.json").exists()


# --------------------------------------------------------------------------- #
# The search, against a fake verifier: which outcomes count as "the same way".

def _error(name, bad):
  return OutputError(name, 1.0 if bad else 0.0, 0.0, 0.1, 0, 0, ())


class FakeVerifier:
  """Fails like a defect in dk on causal cases with T > 16; with batch 1 it
  fails on dq instead (other outputs: must be rejected) and with T <= 16 the
  harness fails (must be rejected too)."""

  def __init__(self):
    self.runs = []

  def check(self, prop, case):
    self.runs.append(case)
    if case.causal and case.seq_len <= 16:
      raise HarnessFailure("harness", case)
    if case.causal:
      bad = {1: {"dq"}, 2: {"dk", "dq"}}.get(case.batch, {"dk"})
      errors = [_error("dk", "dk" in bad), _error("dq", "dq" in bad)]
      try:
        raise PropertyFailure("differs", errors)
      except PropertyFailure as exc:
        raise CaseFailure("failed", case, errors) from exc
    return []


def _impl(**declarations):
  def attention(q, k, v, **kwargs):
    raise AssertionError("not called by the fake verifier")
  for name, value in declarations.items():
    setattr(attention, name, value)
  return declare("fake:attention", attention)


def test_the_search_keeps_the_same_failure_only():
  """The outputs that failed must still fail; others may join (batch 2 fails
  dk and dq: kept), none may leave (batch 1 fails dq alone: rejected)."""
  verifier, prop = FakeVerifier(), get("matches_oracle")
  start = dataclasses.replace(BIG, batch=4, num_q_heads=8, num_kv_heads=2, window_len=5)
  target = minimize.run_case(verifier, prop, start)
  assert (target.kind, target.outputs) == ("failed", frozenset({"dk"}))
  lines = []
  result = minimize.minimize(_impl(), prop, start, target, verifier=verifier, log=lines.append)
  small = result.case
  assert result.stopped == "fixpoint"
  assert (small.seq_len, small.batch) == (17, 2)
  assert (small.num_q_heads, small.num_kv_heads, small.head_dim) == (1, 1, 16)
  assert small.causal and not small.window_len
  assert any("batch 4 -> 2" in line and "accepted: fails on ['dk', 'dq']" in line
             for line in lines)
  assert any("batch 2 -> 1" in line and "rejected: fails on ['dq']" in line for line in lines)
  assert any("T 200 -> 16" in line and "rejected: harness error" in line for line in lines)
  assert len(verifier.runs) == len(set(verifier.runs))  # no case run twice


def test_the_search_stops_at_its_budget():
  verifier, prop = FakeVerifier(), get("matches_oracle")
  target = minimize.run_case(verifier, prop, BIG)
  result = minimize.minimize(_impl(), prop, BIG, target, verifier=verifier, max_attempts=3,
                             log=lambda line: None)
  assert result.stopped == "max attempts" and result.attempts == 3
  assert result.case == BIG  # T 1, 2, 16 were all rejected


def test_candidates_stay_within_the_declarations_and_the_property():
  impl = _impl(ua_head_dims=(32, 64), ua_block_sizes=(64,))
  case = dataclasses.replace(BIG, seq_len=300, head_dim=64, num_q_heads=8, num_kv_heads=4)
  assert minimize.smaller_seq_lens(impl, case) == [1, 2, 16, 17, 32, 33, 64, 65, 128, 129, 256,
                                                   257, 150]
  assert [c.head_dim for _, c in minimize._head_dim_moves(impl, case)] == [32]
  pairs = minimize.smaller_head_pairs(case)
  assert pairs[0] == (1, 1) and all(hq % hkv == 0 and hq <= 8 for hq, hkv in pairs)
  assert (4, 2) in pairs and (2, 1) in pairs and (8, 4) not in pairs
  gqa = get("gqa_equals_repeated_heads")
  assert not minimize.valid(impl, gqa, dataclasses.replace(case, num_q_heads=4, num_kv_heads=4))
  assert minimize.valid(impl, gqa, case)
  assert not minimize.valid(impl, get("matches_oracle"), dataclasses.replace(case, head_dim=16))


def test_the_minimal_file_sits_beside_the_original():
  assert minimize.minimized_path("ua-failures/matches_oracle-ab12.json") == \
      "ua-failures/matches_oracle-ab12.min.json"


def test_a_bias_failure_keeps_only_the_same_outputs_bias():
  """A bias verdict fails with every output within its bound: it names its
  outputs as "<name> (bias)", so that an out-of-tolerance dq, or a failure
  naming no output, does not pass for it."""
  target = minimize.Outcome("failed", frozenset({"dv (bias)"}))
  assert minimize.Outcome("failed", frozenset({"dv (bias)", "dq"})).keeps(target)
  assert not minimize.Outcome("failed", frozenset({"dq"})).keeps(target)
  assert not minimize.Outcome("failed", frozenset({"dq (bias)"})).keeps(target)
  nameless = minimize.Outcome("failed", frozenset())
  assert nameless.keeps(nameless) and not minimize.Outcome("failed", frozenset({"dq"})).keeps(
      nameless)
