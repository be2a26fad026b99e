"""Campaign-level verdicts over all cases of a run, besides each case's own:
pooled bias per output and dtype (bias.py), and precision regressions against
a saved baseline of the same cases (``--ua-save-baseline`` /
``--ua-baseline``; ua-verify ``--save-baseline`` / ``--baseline``).

A baseline holds each case's error/tolerance ratio per output. The ci profile
is derandomized, so a later run draws the same cases; pairs are matched by
property, case digest and output, and only matched pairs are compared. Per
output and dtype, the paired log2 ratios new/old are tested for an increase
with scipy.stats.wilcoxon (one-sided), Holm-corrected over the groups; a group
regresses when that is significant and the mean ratio grew by at least
REGRESSION_FLOOR. Identical code on the same backend gives identical ratios:
no pair differs, and nothing is tested. docs/TOLERANCES.md, "Precision
regressions".
"""

from __future__ import annotations

import collections
import json
import math

from .bias import (BIAS_ALPHA, BIAS_FLOOR_ULPS, CASE_BIAS_FLOOR_ULPS, JUDGED_DTYPES,
                   BiasStats, holm, output_dtype, verdicts)

# A group regresses only if its errors grew by this factor (geometric mean) or more.
REGRESSION_FLOOR = 1.25
REGRESSION_ALPHA = 1e-3
# 2: error/tolerance of the worst element under per-element tolerances (2026-12-02); the
# ratios of format 1 (one tolerance per output) are smaller, and compared with these
# would read as regressions. 3: the tighter floors (docs/TOLERANCES.md, "Tighter floors",
# 2026-12-04), under which the same errors read 1-2x higher.
BASELINE_FORMAT = 3


def _group(output: str, dtype: str) -> str:
  return f"{output}/{dtype}"


# Fewer cases than this in a group are no pool: one case's own mean (up to
# 0.14 ulp on correct cases, bias.py) would be judged against the pooled floor.
# A time-boxed ci run under jax 0.12.0.1 pooled 12 float16 cases, dk at -0.11.
POOLED_MIN_CASES = 20


def pooled_bias(records: list[dict]) -> dict[str, dict]:
  """bias.verdicts over the campaign: each judged output's signed-error counts
  summed over every case per output and dtype; a group of fewer than
  POOLED_MIN_CASES cases is judged with the case floor."""
  pooled: dict[str, BiasStats] = collections.defaultdict(BiasStats)
  cases: collections.Counter = collections.Counter()
  for r in records:
    for output, stats in (r.get("bias") or {}).items():
      if output_dtype(output, r["dtype"]) in JUDGED_DTYPES:
        pooled[_group(output, r["dtype"])] += BiasStats(**stats)
        cases[_group(output, r["dtype"])] += 1
  result = verdicts(dict(sorted(pooled.items()))) if pooled else {}
  for group, v in result.items():
    v["cases"] = cases[group]
    if cases[group] < POOLED_MIN_CASES:
      v["biased"] = v["p_holm"] < BIAS_ALPHA and abs(v["mean_ulps"]) >= CASE_BIAS_FLOOR_ULPS
  return result


def baseline_entries(records: list[dict]) -> dict[str, dict]:
  """{property/case digest: {dtype, ratios}} of the cases that passed."""
  return {f"{r['property']}/{r['case']}": {"dtype": r["dtype"], "ratios": r["ratios"]}
          for r in records if r["status"] == "passed" and r.get("ratios")}


def save_baseline(path: str, records: list[dict], meta: dict) -> None:
  with open(path, "w") as f:
    json.dump({"format": BASELINE_FORMAT, **meta, "cases": baseline_entries(records)}, f,
              indent=1, sort_keys=True)


def load_baseline(path: str) -> dict:
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
    found = data.get("format") if isinstance(data, dict) else None
    raise ValueError(f"{path} is not a baseline file of format {BASELINE_FORMAT} "
                     f"(written by --ua-save-baseline)"
                     + (f"; it has format {found}, recorded under another tolerance model: "
                        f"record it again with this suite" if found is not None else ""))
  return data


def platform() -> dict:
  """What a baseline's errors depend on besides the code: the jax release and
  the backend (XLA's CPU and GPU code differ in their roundings)."""
  import jax
  return {"jax": jax.__version__, "backend": jax.default_backend()}


def same_platform(baseline: dict) -> bool:
  return all(baseline.get(key) == value for key, value in platform().items())


def platform_note(baseline: dict) -> str:
  return (f"the baseline was recorded on jax {baseline.get('jax')} ({baseline.get('backend')}), "
          f"this run is on jax {platform()['jax']} ({platform()['backend']}): its comparison "
          f"is shown, not judged")


def _paired_log_ratios(baseline: dict, records: list[dict]) -> dict[str, list[float]]:
  """Per output/dtype: log2(new / old) of every matched pair with both ratios
  positive and finite."""
  old_cases = baseline["cases"]
  out = collections.defaultdict(list)
  for key, entry in baseline_entries(records).items():
    old = old_cases.get(key)
    if old is None:
      continue
    for output, new_ratio in entry["ratios"].items():
      old_ratio = old["ratios"].get(output)
      if old_ratio and new_ratio and all(math.isfinite(x) and x > 0
                                         for x in (old_ratio, new_ratio)):
        out[_group(output, entry["dtype"])].append(math.log2(new_ratio / old_ratio))
  return out


def compare_with_baseline(baseline: dict, records: list[dict]) -> dict[str, dict]:
  """Per output/dtype: matched pairs, the geometric mean of new/old, the
  one-sided Wilcoxon p-value (Holm-adjusted over the groups that differ), and
  ``regressed``."""
  from scipy.stats import wilcoxon
  groups = _paired_log_ratios(baseline, records)
  p = {}
  for name, logs in groups.items():
    moved = [x for x in logs if x != 0.0]
    p[name] = 1.0 if len(moved) < 2 else float(wilcoxon(moved, alternative="greater").pvalue)
  adjusted = holm(p)
  out = {}
  for name, logs in sorted(groups.items()):
    growth = 2.0 ** (sum(logs) / len(logs))
    out[name] = {"pairs": len(logs), "changed": sum(x != 0.0 for x in logs),
                 "mean_growth": growth, "p_holm": adjusted[name],
                 "regressed": adjusted[name] < REGRESSION_ALPHA and growth >= REGRESSION_FLOOR}
  return out


def summary_lines(report: dict) -> list[str]:
  """The terminal lines of the campaign verdicts in ``report``."""
  lines = [f"baseline: {report['baseline_note']}"] if report.get("baseline_note") else []
  if report.get("bias"):
    lines.append(
        f"bias (per output/dtype, all cases pooled): the mean signed error in ulps of the "
        f"output's dtype, + away from zero, against the float64 oracle; BIASED when the "
        f"sign test's Holm-corrected p < {BIAS_ALPHA:g} and |mean| >= {BIAS_FLOOR_ULPS} ulp "
        f"({CASE_BIAS_FLOOR_ULPS} under {POOLED_MIN_CASES} cases): a systematic rounding "
        f"that training would accumulate (docs/TOLERANCES.md)")
  for name, v in report.get("bias", {}).items():
    flag = "BIASED" if v["biased"] else "ok"
    lines.append(f"bias {name:18} {flag:6} mean {v['mean_ulps']:+.4f} ulp over {v['n']} "
                 f"elements ({v['below']} toward zero, {v['above']} away; rows "
                 f"{v.get('rows_below', 0)} and {v.get('rows_above', 0)}), Holm p "
                 f"{v['p_holm']:.2e}")
  for name, v in report.get("baseline", {}).items():
    flag = "REGRESSED" if v["regressed"] else "ok"
    lines.append(f"baseline {name:14} {flag:9} err/tol x{v['mean_growth']:.3f} over "
                 f"{v['pairs']} cases ({v['changed']} changed), Holm p {v['p_holm']:.2e}")
  return lines
