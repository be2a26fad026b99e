"""The statistical verdicts (properties/judge/bias.py, properties/judge/gates.py): a
planted rounding bias and a planted precision regression, each inside the
max-abs bound, fail; rounding to nearest, exact results over float64 noise and
identical reruns do not."""

import json

import ml_dtypes
import numpy as np
import pytest

from properties.judge import bias, gates
from properties.judge.bias import BiasStats, signed_ulps, verdicts
from test_suite_plugin import run_suite

RNG = np.random.default_rng(0)


def _rounded(x, toward_zero: bool):
  """x (float64) in bfloat16, to nearest or toward zero."""
  if not toward_zero:
    return x.astype(ml_dtypes.bfloat16)
  bits = x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
  return bits.view(np.float32).astype(ml_dtypes.bfloat16)


def test_rounding_toward_zero_is_biased_and_to_nearest_is_not():
  oracle = RNG.normal(size=4000)
  for toward_zero, biased in ((True, True), (False, False)):
    ulps = signed_ulps(_rounded(oracle, toward_zero), oracle, "bfloat16")
    assert np.all(np.abs(ulps) <= 1.0)  # within one ulp: inside any max-abs bound
    verdict = verdicts({"out": BiasStats.of(ulps)})["out"]
    assert verdict["biased"] is biased, verdict
  assert verdicts({"out": BiasStats.of(signed_ulps(_rounded(oracle, True), oracle,
                                                   "bfloat16"))})["out"]["mean_ulps"] < -0.4


def test_exact_results_over_float64_noise_have_no_sign():
  """A row of one visible key: dq is exactly 0, the oracle's 1e-16 of noise
  (always of one sign on a case) must not count as an error toward zero."""
  oracle = np.full(600, 1.5e-16)
  stats = BiasStats.of(signed_ulps(np.zeros(600), oracle, "float16"))
  assert stats.below == stats.above == 0
  assert not verdicts({"dq": stats})["dq"]["biased"]


def test_an_oracle_that_rounds_to_zero_is_not_measured():
  """A saturated cap's exact derivative leaves whole dq rows at 1e-136 (the
  H200 cases of issue 61, half of dq): they round to 0 in float16, and every
  kernel's 0 there is exact. Counted as differences of 0 they halved the mean
  of a kernel rounding the other half toward zero, under the case floor."""
  oracle = RNG.normal(size=(400, 32))
  oracle[::2] *= 1e-136
  near = oracle.astype(np.float16)
  toward = np.where(np.abs(near) > np.abs(oracle), np.nextafter(near, np.float16(0)), near)
  got = toward.astype(np.float64)  # 0 on the rows of 1e-136
  stats = BiasStats.of(signed_ulps(got, oracle, "float16"))
  assert stats.n == oracle.size // 2
  verdict = verdicts({"dq": stats}, floor=0.35)["dq"]
  assert verdict["biased"] and verdict["mean_ulps"] < -0.35, verdict


def test_a_small_shift_below_the_floor_passes_however_significant():
  oracle = RNG.normal(size=20000)
  got = (oracle + 0.05 * np.abs(oracle) * 2.0 ** -7 * np.sign(oracle)).astype(np.float64)
  verdict = verdicts({"out": BiasStats.of(signed_ulps(got, oracle, "bfloat16"))})["out"]
  assert verdict["p_holm"] < 1e-6 and not verdict["biased"], verdict


def _records(ratios_by_case, dtype="float32"):
  return [{"property": "matches_oracle", "case": f"c{i}", "status": "passed", "dtype": dtype,
           "ratios": ratios} for i, ratios in enumerate(ratios_by_case)]


def test_baseline_comparison_flags_a_doubled_error_only():
  old = [{"out": r, "dq": 0.5 * r} for r in RNG.uniform(0.01, 0.3, 30)]
  baseline = {"format": gates.BASELINE_FORMAT,
              "cases": gates.baseline_entries(_records(old))}
  same = gates.compare_with_baseline(baseline, _records(old))
  assert not any(v["regressed"] for v in same.values())
  assert all(v["changed"] == 0 for v in same.values())
  doubled = [{"out": 2 * r["out"], "dq": r["dq"]} for r in old]
  result = gates.compare_with_baseline(baseline, _records(doubled))
  assert result["out/float32"]["regressed"] and result["out/float32"]["mean_growth"] == \
      pytest.approx(2.0)
  assert not result["dq/float32"]["regressed"]
  slight = [{"out": 1.1 * r["out"], "dq": r["dq"]} for r in old]  # below the 1.25x floor
  assert not gates.compare_with_baseline(baseline, _records(slight))["out/float32"]["regressed"]


def test_a_run_fails_a_planted_bias_and_a_planted_precision_regression(tmp_path):
  """End to end, with --ua-save-baseline / --ua-baseline: the reference's
  bfloat16 cases saved as a baseline; the reference with its bfloat16 out
  rounded to 7 bits (twice the error) passes every case's bound and fails the
  baseline; rounded toward zero, it passes every bound and fails the bias
  verdict."""
  baseline = tmp_path / "baseline.json"
  # 6 configurations of 4 input seeds each: 24 cases at 6 compiles, not 24. With 3 seeds
  # too few pairs fell in out/bfloat16 (the rest in segment groups) for their one-sided p,
  # times Holm's count of groups, to go below REGRESSION_ALPHA.
  select = ("-k", "matches_oracle-bfloat16 and not long and not mask and not cap and not feature",
            "--ua-max-examples=6", "--ua-seeds=4")
  proc, report = run_suite(tmp_path, "ua_reference:attention", *select,
                           f"--ua-save-baseline={baseline}")
  assert proc.returncode == 0, proc.stdout[-3000:]
  saved = json.loads(baseline.read_text())
  assert 16 <= len(saved["cases"]) <= 24  # without --ua-max-examples: 15 x 4
  proc, report = run_suite(tmp_path, "outside_kernels:coarse_reference_attention", *select,
                           f"--ua-baseline={baseline}")
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert not report["failures"]  # every case within its bound, no bias
  regressed = {name for name, v in report["baseline"].items() if v["regressed"]}
  assert regressed == {"out/bfloat16"}, report["baseline"]
  assert report["baseline"]["out/bfloat16"]["mean_growth"] > 1.5
  assert "REGRESSED" in proc.stdout
  proc, report = run_suite(tmp_path, "outside_kernels:toward_zero_reference_attention", *select)
  assert proc.returncode == 1, proc.stdout[-3000:]
  assert {f["property"] for f in report["failures"]} == {"matches_oracle"}, report["failures"]
  assert {tuple(f["failed_outputs"]) for f in report["failures"]} == {("out (bias)",)}
  # The pooled verdict: toward zero, and significant. The run stops at its first failing
  # test, so fewer than POOLED_MIN_CASES cases pool and the case floor (0.35 ulp) would
  # judge them, while the offset distribution's near one-hot rows (outputs exactly a
  # bfloat16 value) dilute the mean to a fraction of an ulp.
  pooled = report["bias"]["out/bfloat16"]
  assert pooled["p_holm"] < bias.BIAS_ALPHA and pooled["mean_ulps"] < -0.1, report["bias"]
  assert not report["bias"]["dq/bfloat16"]["biased"], report["bias"]


def test_a_rows_shared_sign_is_one_draw_per_row():
  """On a row of one visible key dq = ds * k: ds cancels to float32 noise of
  one sign, which every element of the row then carries (two rows of 64 dq
  elements, all away from zero, on the H200; docs/TOLERANCES.md, "Bias"). Two
  rows are two draws, not 128; 200 rows all toward zero are a bias."""
  k = RNG.normal(size=(2, 64))
  oracle = 1e-7 * np.sign(k)
  got = oracle * (1 + 2.0 ** -8)  # one ulp away from zero, on every element of two rows
  ulps = signed_ulps(got, oracle, "bfloat16", reference=oracle)
  stats = BiasStats.of(ulps)
  assert (stats.above, stats.rows_above) == (128, 2)
  assert not verdicts({"dq": stats}, floor=0.35)["dq"]["biased"]
  oracle = RNG.normal(size=(200, 64))
  stats = BiasStats.of(signed_ulps(_rounded(oracle, True), oracle, "bfloat16"))
  assert stats.rows_below == 200 and verdicts({"dv": stats}, floor=0.35)["dv"]["biased"]


def test_an_element_the_reference_misses_is_not_measured():
  """Where the same-precision reference is itself more than an ulp from the
  oracle, its value is its own arithmetic error, not a rounding: a saturated
  tanh cap's 1 - tanh^2 is 0 in a kernel and a float32 remnant in a float32
  reference, while the oracle's is 1e-14. Every such element is left out; an
  element the reference rounds is measured."""
  oracle = 1e-7 * np.sign(RNG.normal(size=(300, 16)))
  reference = oracle * (1 + 2.0 ** -5)  # four bfloat16 ulps off
  stats = BiasStats.of(signed_ulps(np.zeros_like(oracle), oracle, "bfloat16", reference))
  assert stats.n == 0 and not verdicts({"dq": stats}, floor=0.35)["dq"]["biased"]
  near = oracle * (1 + 2.0 ** -9)  # half an ulp: the reference rounds there
  stats = BiasStats.of(signed_ulps(_rounded(oracle, True), oracle, "bfloat16", near))
  assert stats.n == oracle.size and verdicts({"dq": stats}, floor=0.35)["dq"]["biased"]


def test_a_baseline_of_another_tolerance_model_is_refused(tmp_path):
  """Format 1 ratios (one tolerance per output) are smaller than today's (per
  element): compared, they would read as regressions; loading says so instead."""
  path = tmp_path / "old.json"
  path.write_text(json.dumps({"format": 1, "cases": {}}))
  with pytest.raises(ValueError, match="format 1, recorded under another tolerance model"):
    gates.load_baseline(str(path))
