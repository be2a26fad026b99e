"""The suite as users run it: the installed plugin collecting properties.suite
against outside implementations (tests/outside_kernels.py), in a subprocess in
an empty directory. Declared tiles expose a tile-bound defect in the ci
profile; a crashing or hanging case is reported with its case file and replay
command, and the run goes on; the oracle's own errors are the harness's."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from properties.checks import registry

from properties.model.case import Case, load_case_file
from properties.judge.runner import REFERENCE, Harness, HarnessError
from properties.run.verifier import HarnessFailure, Verifier

TESTS = Path(__file__).parent


def run_suite(tmp_path, impl, *args, timeout=900, env=None):
  """The installed suite on ``impl`` in a subprocess; ``env`` overrides variables."""
  env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(
      [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
  report = tmp_path / "report.json"
  cmd = [sys.executable, "-m", "pytest", "--pyargs", "properties.suite", "-q",
         "-p", "no:cacheprovider", f"--impl={impl}", f"--ua-report={report}",
         f"--ua-failures={tmp_path / 'failures'}", *args]
  proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=timeout)
  return proc, (json.loads(report.read_text()) if report.exists() else None)


def test_declared_tiles_expose_a_window_bound_defect_in_the_ci_profile(tmp_path):
  """ua_block_sizes = (64,): the ci profile's window tests draw lengths and
  windows around 64-row tile edges (lengths up to 3 * 64 + 1), where the window
  bound of outside_kernels's implementation drops visible keys. Only the
  focused window tests run: the rest of the profile took four minutes of CI
  to add nothing this test asserts."""
  proc, report = run_suite(tmp_path, "outside_kernels:window_bug_attention",
                           "-k", "mask-window")
  assert proc.returncode == 1, proc.stdout[-3000:]
  failed = [f for f in report["failures"] if f["status"] == "failed"]
  assert failed, report
  # The report alone says what failed, on which case (its case files may stay
  # on the machine that ran it).
  assert all("PropertyFailure" in f["message"] and f["config"]["seq_len"] for f in failed)
  cases = [load_case_file(p)["case"] for p in (tmp_path / "failures").glob("*.json")]
  assert any(0 < c.window_len < c.seq_len and c.seq_len > 64 for c in cases), cases


def test_a_crashing_case_is_reported_and_the_run_goes_on(tmp_path):
  proc, report = run_suite(tmp_path, "outside_kernels:crashing_attention",
                           "-n", "1", "-k", "matches_oracle and (float32 or float16) and not bfloat16 "
                           "and not cap and not mask and not long and not feature")  # not the focused tests
  assert proc.returncode == 1
  crashed = report["crashed"]
  assert len(crashed) == 2, report  # one per test: the worker was replaced after the first
  files = sorted((tmp_path / "failures").glob("*.json"))
  payloads = [load_case_file(p) for p in files]
  assert {p["status"] for p in payloads} == {"crashed"}
  assert all(p["case"].seq_len > 16 and p["replay"].startswith("ua-repro ") for p in payloads)
  assert crashed[0]["replay"] in proc.stdout


def test_a_hanging_case_is_ended_by_its_timeout(tmp_path):
  proc, report = run_suite(tmp_path, "outside_kernels:hanging_attention", "-n", "1",
                           "--ua-case-timeout=10", "-k",
                           "matches_oracle and float32 and not cap and not mask and not long and not feature")
  assert proc.returncode == 1
  assert [c["status"] for c in report["crashed"]] == ["timeout"], report


def test_a_hang_in_one_process_ends_the_run_with_the_failure_status_and_its_file(tmp_path):
  """No worker to replace (-n 0, as on a TPU): the watchdog says which case hung
  and its replay, keeps its file (status timeout) and exits with FAIL's status."""
  proc, _ = run_suite(tmp_path, "outside_kernels:hanging_attention", "--ua-case-timeout=5",
                      "-k", "matches_oracle and float32 and not cap and not mask and not long and not feature")
  assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
  [path] = (tmp_path / "failures").glob("*.json")
  payload = load_case_file(path)
  assert payload["status"] == "timeout"
  assert "ran past its timeout of 5 s" in proc.stderr and payload["replay"] in proc.stderr


def test_every_case_has_a_timeout_scaled_to_its_size_and_kept_to_the_box():
  """No profile leaves a case unbounded: the base, a second per 1e8
  multiply-adds, and under a time box no more than the grace past its end."""
  from properties.model.profiles import PROFILES
  from properties.run.verifier import BOX_GRACE_SECONDS, case_timeout
  small = Case(batch=1, seq_len=64, num_q_heads=2, num_kv_heads=2, head_dim=32, dtype="float32")
  big = dataclasses.replace(small, seq_len=32768, num_q_heads=8, head_dim=128)
  assert all(p.case_timeout_base > 0 for p in PROFILES.values())
  assert case_timeout(small, 600.0) == pytest.approx(600.0, abs=0.01)
  assert case_timeout(big, 600.0) == pytest.approx(600.0 + 8 * 32768 ** 2 * 128 / 1e8)
  # A one-minute box: a small case started at its start ends at most the grace after it.
  assert case_timeout(small, 600.0, deadline=1060.0, now=1000.0) == pytest.approx(
      60.0 + BOX_GRACE_SECONDS, abs=0.01)
  # One started after the box ended: the grace alone (and its size's share).
  assert case_timeout(small, 600.0, deadline=1000.0, now=1500.0) == pytest.approx(
      BOX_GRACE_SECONDS, abs=0.01)
  assert case_timeout(small, 600.0, deadline=10_000.0, now=0.0) == pytest.approx(600.0, abs=0.01)


def test_a_spent_time_box_skips_the_rest(tmp_path):
  proc, report = run_suite(tmp_path, "ua_reference:attention", "--ua-minutes=0",
                           "-k", "deterministic")
  assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:]


def test_an_oracle_error_is_a_harness_error(tmp_path, monkeypatch):
  """Not a failure of the implementation: reported as the harness's, with its case."""
  def broken(cls, case):
    raise HarnessError("out of memory (simulated)")
  monkeypatch.setattr(Harness, "of", classmethod(broken))
  records = []
  verifier = Verifier(REFERENCE, str(tmp_path), record=records.append)
  case = Case(batch=1, seq_len=5, num_q_heads=1, num_kv_heads=1, head_dim=16, dtype="float32")
  with pytest.raises(HarnessFailure, match="harness error"):
    verifier.check(registry.get("matches_oracle"), case)
  [path] = tmp_path.glob("*.json")
  assert load_case_file(path)["status"] == "harness"
  assert records[0]["status"] == "harness"


def test_the_report_counts_a_replayed_case_once():
  """Hypothesis replays a failing example before it reports it: the report
  counts that case once, with its last outcome, in every group it belongs to."""
  from properties.campaign.report import build_report
  record = lambda case, status, ratio: {
      "property": "matches_oracle", "case": case, "oracle": True,
      "groups": ["causal", "dtype:float32"], "status": status, "ratio": ratio,
      "seconds": 1.0, "replay": f"ua-repro {case}.json" if status != "passed" else "",
      "failed_outputs": ["dk"] if status != "passed" else []}
  report = build_report([record("a", "passed", 0.2), record("b", "failed", 2.7),
                         record("b", "failed", 2.7)], [], 60.0)
  assert report["cases"] == report["oracle_cases"] == 2
  assert report["feature_groups"]["causal"] == {"cases": 2, "failures": 1, "harness_errors": 0,
                                                "worst_ratio": 2.7, "seconds": 2.0}
  assert len(report["failures"]) == 1 and report["oracle_cases_per_minute"] == 2.0


def test_more_oracle_chunks_come_after_every_other_test():
  """--ua-oracle-chunks (ua-verify --oracle-chunks, 100 under --minutes): the
  profile's own tests first and unchanged (a short time box still reaches every
  property), then more tests of the oracle properties, one per dtype and
  chunk, each its own Hypothesis seed (a distinct chunk id)."""
  from properties.campaign.schedule import property_tests
  from properties.model.profiles import PROFILES

  gpu = PROFILES["gpu"]
  own = property_tests(gpu)
  more = property_tests(gpu, 12)
  assert [t.id for t in more[:len(own)]] == [t.id for t in own]
  extra = more[len(own):]
  assert extra and all(registry.get(t.property).oracle and t.chunk >= gpu.oracle_chunks
                       for t in extra)
  assert {t.chunk for t in extra} == {10, 11}
  assert len({t.id for t in more}) == len(more)
  assert property_tests(gpu, 3) == own  # fewer than the profile's: the profile's


def test_the_chunked_properties_further_chunks_follow_the_oracles():
  """The exact-mask and hidden-key properties' share of a time box is their
  first round's (chunked_box_share); their further chunks wait for the
  oracle's profile chunks, before the extra ones a time box asks for."""
  from properties.campaign.schedule import first_round_size, property_tests
  from properties.model.profiles import PROFILES

  gpu = PROFILES["gpu"]
  tests = property_tests(gpu, 12)[first_round_size(gpu):]
  kind = ["chunked" if t.property in gpu.chunked_properties else
          "extra" if t.chunk >= gpu.oracle_chunks else "oracle" for t in tests]
  assert kind == sorted(kind, key=["oracle", "chunked", "extra"].index)
  assert {t.chunk for t, k in zip(tests, kind) if k == "chunked"} == \
      set(range(1, gpu.oracle_chunks))
  assert {t.property for t, k in zip(tests, kind) if k == "chunked"} == \
      set(gpu.chunked_properties)


@pytest.mark.parametrize("profile", ["ci", "gpu"])
def test_a_time_box_starts_one_test_of_every_property_first(profile):
  """The first round of property_tests holds one test of every property (each
  oracle property per dtype) and comes before any further chunk: on one H200 a
  two-minute box that began with ten chunks of matches_oracle per dtype ended
  before seven properties had started."""
  from properties.model.capabilities import DTYPES
  from properties.campaign.schedule import first_round_size, property_tests
  from properties.model.profiles import PROFILES

  tests = property_tests(PROFILES[profile], 100)
  first = tests[:first_round_size(PROFILES[profile])]
  assert {t.property for t in first} == {p.name for p in registry.PROPERTIES}
  assert all(t.chunk == 0 for t in first)
  oracle_per_dtype = [p.name for p in registry.PROPERTIES if p.oracle and p.per_dtype]
  assert {(t.property, t.dtype) for t in first if t.property in oracle_per_dtype} == {
      (name, dtype) for name in oracle_per_dtype for dtype in DTYPES}
  assert all(t.chunk > 0 for t in tests[len(first):])


def test_the_first_round_spreads_each_propertys_tests_through_it():
  """pytest-xdist starts a time box's first round in order, its last tests when
  the box is nearly spent: each property's tests are spread through the round
  (a property of four tests has one in each quarter), not left at its end,
  where the hidden-key property's focused tests ran one case each on the H200."""
  from properties.campaign.schedule import first_round_size, property_tests
  from properties.model.profiles import PROFILES

  gpu = PROFILES["gpu"]
  # Places in the round as a deterministic implementation meets them: the property for
  # non-deterministic ones shares its place with `deterministic` and is skipped at once.
  first = [t for t in property_tests(gpu)[:first_round_size(gpu)]
           if t.property != "reruns_within_tolerance"]
  size = len(first)
  for name in gpu.chunked_properties:
    at = [i for i, t in enumerate(first) if t.property == name]
    assert len(at) == 4
    assert [i * 4 // size for i in at] == [0, 1, 2, 3], (name, at)
  oracle_at = [i for i, t in enumerate(first) if t.property == "matches_oracle"]
  assert oracle_at[0] == 0 and oracle_at[-1] >= size - 3  # most tests: at both ends
  long_at = [i for i, t in enumerate(first) if t.focus == "long"]
  assert max(long_at) < size // 4  # the slowest cases start early


@pytest.mark.parametrize("workers", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("first_round", [1, 5, 13, 40])
def test_a_worker_using_each_share_whole_starts_all_its_first_round_tests(workers, first_round):
  """A worker holding its part of an evenly spread first round, each test
  using its whole share (time_share), starts every one of them inside the box,
  and the last of them is given all that is left."""
  from properties.campaign.schedule import time_share

  box, now = 120.0, 0.0
  held = -(-first_round // workers)
  for started_here in range(held):
    assert now < box
    share = time_share(box - now, workers, first_round, started_here)
    assert share > 0
    now += share
  assert now == pytest.approx(box)


def test_a_chunked_propertys_first_round_takes_its_share_of_the_box():
  """The gpu profile's exact-mask and hidden-key properties: their first-round
  tests (each property's four) may go on starting cases for 12% of the box's
  worker-seconds between them, whatever their turn in the round gives them; no
  other profile sets a share."""
  from properties.campaign.schedule import chunked_share
  from properties.model.profiles import PROFILES

  import time
  import types

  from properties.campaign.hooks import _State
  from properties.campaign.schedule import PropertyTest, first_round_size, time_share
  from properties.campaign.session import Suite

  gpu = PROFILES["gpu"]
  tests = 1 + len(gpu.chunked_focuses)
  assert tests == 4
  assert tests * chunked_share(gpu, 16, 224.0) == pytest.approx(0.12 * 16 * 224.0)
  assert chunked_share(gpu, 16, 0.0) == 0.0
  assert all(chunked_share(p, 16, 224.0) == 0.0 for p in PROFILES.values() if p is not gpu)
  # A worker of 16 whose first first-round test begins 40 s into a 224-second box:
  # its turn in the round (61 s) is less than the share (108 s); a hidden-key test
  # gets the share, an oracle test its turn.
  workers, box, at = 16, 224.0, 40.0
  suite = types.SimpleNamespace(profile=gpu, config=types.SimpleNamespace(
      workerinput={"workercount": workers}))
  now = time.time()
  turn = time_share(box - at, workers, first_round_size(gpu), 0)
  share = chunked_share(gpu, workers, box)
  assert turn < share
  for prop, expected in (("hidden_keys_do_not_leak", share), ("matches_oracle", turn)):
    state = _State(deadline=now + box - at, started=now - at)
    ends = Suite._share_ends(suite, PropertyTest(prop, chunk=0), state)
    assert ends - now == pytest.approx(expected, abs=0.5), prop


def test_a_short_time_box_starts_each_selected_property(tmp_path):
  """Two properties of the first round under a box shorter than the suite's
  first round: each starts its first case (a test's share bounds only the
  cases after its first)."""
  proc, report = run_suite(tmp_path, "ua_reference:attention", "--ua-minutes=0.25",
                           "-k", "zero_z_loss or unit_temperature", timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:]
  ran = report["properties"]
  assert {"zero_z_loss_is_no_z_loss", "unit_temperature_is_none"} <= set(ran), ran
  assert all(ran[name]["cases"] >= 1 for name in ran), ran


def test_a_time_boxed_campaign_hands_out_tests_one_at_a_time():
  import argparse

  from properties.cli.verify import _worker_args, _xdist_has_maxschedchunk

  boxed = argparse.Namespace(gpus=1, workers_per_gpu=8, workers=None, minutes=2.0)
  unboxed = argparse.Namespace(gpus=0, workers="2", minutes=None)
  if _xdist_has_maxschedchunk():
    assert _worker_args(boxed)[-2:] == ["--maxschedchunk", "1"]
  else:  # an xdist before 3.2 would reject the option
    assert "--maxschedchunk" not in _worker_args(boxed)
  assert "--maxschedchunk" not in _worker_args(unboxed)


@pytest.mark.parametrize("args, message", [
    (("--impl=outside_kernels:no_such_function",), "--impl outside_kernels:no_such_function"),
    (("--ua-import=no_such_module_test",), "--ua-import no_such_module_test"),
    (("--ua-minutes=-1",), "--ua-minutes must be at least 0"),
    (("--ua-seeds=0",), "--ua-seeds must be at least 1"),
    (("--ua-max-examples=0",), "--ua-max-examples must be at least 1"),
])
def test_plain_pytest_misuse_is_one_usage_error(tmp_path, args, message):
  """The plugin checks its options before collecting: one usage error (pytest's
  status 4), not a failure of every test or an internal error."""
  impl = [a for a in args if a.startswith("--impl=")]
  proc, report = run_suite(tmp_path, impl[0][7:] if impl else "outside_kernels:tanh_only_attention",
                           *[a for a in args if not a.startswith("--impl=")], timeout=300)
  assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert message in proc.stderr and "INTERNALERROR" not in proc.stderr + proc.stdout
  assert report is None


def test_the_ua_profiles_are_registered_before_hypothesis_loads_one(tmp_path):
  """The plugin's pytest_configure runs before Hypothesis's (tryfirst), which
  loads --hypothesis-profile: a ua-* profile must be registered by then."""
  proc, _ = run_suite(tmp_path, "ua_reference:attention", "--hypothesis-profile=ua-ci",
                      "--ua-minutes=0", "-k", "deterministic", timeout=300)
  assert proc.returncode == 0 and "1 skipped" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_chunked_properties_take_seeds_only_where_the_seed_matters():
  """The gpu profile's exact-mask and hidden-key tests run further input seeds
  of a compiled configuration (a campaign's share of their cases), but the
  exact mask only where the seed draws its segment ids: without documents its
  inputs are fixed encodings, and a second seed would repeat the first."""
  from properties.campaign.schedule import input_seeds, property_tests
  from properties.model.profiles import PROFILES

  gpu, ci = PROFILES["gpu"], PROFILES["ci"]
  plain = Case(batch=1, seq_len=300, num_q_heads=2, num_kv_heads=2, head_dim=32,
               dtype="bfloat16", causal=True)
  packed = dataclasses.replace(plain, segments="packed")
  mask, hidden = registry.get("mask_is_exact"), registry.get("hidden_keys_do_not_leak")
  oracle = registry.get("matches_oracle")
  assert input_seeds(mask, plain, gpu) == 1
  assert input_seeds(mask, packed, gpu) == gpu.chunked_seeds > 1
  assert input_seeds(hidden, plain, gpu) == gpu.chunked_seeds
  assert input_seeds(hidden, plain, ci) == 1
  assert input_seeds(oracle, plain, gpu) == gpu.seeds
  assert input_seeds(oracle, plain, gpu, given=3) == 3
  focused = [t for t in property_tests(gpu) if t.property in gpu.chunked_properties and t.focus]
  assert {(t.property, t.focus) for t in focused} == {
      (p, f) for p in gpu.chunked_properties for f in gpu.chunked_focuses}
  assert all(t.chunk == 0 for t in focused)  # first round: a time box starts them early
