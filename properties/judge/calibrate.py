"""Calibrates the tolerance model from data: python -m properties.judge.calibrate.

Runs N random cases of an implementation believed correct, records for each
output its largest error against the float64 oracle, the same-precision
reference's, and the error/tolerance of its worst element under the current
model, then prints per (dtype, output) the distributions of err_impl / err_ref
and of error/tolerance, and writes everything as JSON (for docs/TOLERANCES.md).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import json
import time

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ..model.capabilities import load_impl
from .runner import Harness, evaluate
from ..model.profiles import BUCKETS
from ..model.strategies import cases
from .tolerance import ALPHA, FLOOR


def collect(impl, n: int, buckets, seed: int, log=print):
  records = []
  start = time.time()

  @settings(max_examples=n, derandomize=True, database=None, deadline=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck))
  @given(st.data())
  def run(data):
    case = data.draw(cases(buckets, impl))
    case = dataclasses.replace(case, seed=case.seed ^ seed)
    result = evaluate(impl, case)
    for e in Harness.of(case).score(result):
      records.append({"dtype": case.dtype, "output": e.name, "err": e.max_abs_err,
                      "ref_err": e.ref_err, "ratio": e.ratio, "err_at_worst": e.error,
                      "tol_at_worst": e.tolerance,
                      "nonfinite": e.nan_count + e.inf_mismatch, "case": case.to_dict()})
    if len(records) % 50 < 5:
      log(f"{len(records)} records, {time.time() - start:.0f} s")

  run()
  return records


def add_floors(records) -> None:
  """Fills in ``floor`` for records of the global-floor model saved before that
  model's floor changed (recomputes each case's oracle; errors are kept as
  measured). The per-element model's records carry their ratios instead."""
  from ..model.case import Case
  cache = {}
  for r in records:
    if "floor" in r or "ratio" in r:
      continue
    case = Case.from_dict(r["case"])
    if case not in cache:
      cache[case] = {name: float(np.max(floor)) for name, (_, floor)
                     in Harness.of(case).bounds.items()}
    r["floor"] = cache[case][r["output"]]


def _ratios(rows, name):
  """(err/tol, err in units of the reference's error or the floor, the share
  where the reference's part of the tolerance is the larger) of records: those
  of the per-element model at their worst element, the reference's error and
  the impl's as maxima over the output (the share is not recorded: None); those
  of the global-floor model (files before 2026-12-02) under that model."""
  if all("ratio" in r for r in rows):
    ratio = np.array([r["ratio"] for r in rows])
    err = np.array([r["err"] for r in rows])
    ref = np.array([r["ref_err"] for r in rows])
    with np.errstate(divide="ignore", invalid="ignore"):
      ratio_ref = np.where(err == 0, 0.0, err / ref)
    return ratio, ratio_ref, None
  err = np.array([r["err"] for r in rows])
  ref = np.array([r["ref_err"] for r in rows])
  floor = np.array([r["floor"] for r in rows])
  tol = ALPHA[name] * ref + floor
  ratio = np.where(tol > 0, err / np.where(tol > 0, tol, 1), np.where(err > 0, np.inf, 0))
  with np.errstate(divide="ignore", invalid="ignore"):
    ratio_ref = np.where(err == 0, 0.0, err / np.maximum(ref, floor))
  return ratio, ratio_ref, float(np.mean(ALPHA[name] * ref > floor))


def summarize(records) -> dict:
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r["dtype"], r["output"])].append(r)
  summary = {}
  for (dtype, name), rows in sorted(groups.items()):
    ratio_tol, ratio_ref, alpha_share = _ratios(rows, name)
    summary[f"{dtype}/{name}"] = {
        "n": len(rows),
        "err_over_ref_p50": float(np.percentile(ratio_ref, 50, method="nearest")),
        "err_over_ref_p90": float(np.percentile(ratio_ref, 90, method="nearest")),
        "err_over_ref_p99": float(np.percentile(ratio_ref, 99, method="nearest")),
        "err_over_ref_max": float(ratio_ref.max()),
        "err_over_tol_p50": float(np.percentile(ratio_tol, 50)),
        "err_over_tol_p99": float(np.percentile(ratio_tol, 99)),
        "worst_err_over_tol": float(ratio_tol.max()),
        "alpha_term_share": alpha_share,
        "alpha": ALPHA[name], "floor_coefficient": FLOOR[dtype],
        "nonfinite": int(sum(r["nonfinite"] for r in rows)),
    }
  return summary


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--impl", default="ua_kernels:attention")
  parser.add_argument("--cases", type=int, default=1000)
  parser.add_argument("--buckets", default="ci", choices=sorted(BUCKETS))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="calibration.json")
  parser.add_argument("--summarize", nargs="+", default=None,
                      help="only summarize these saved JSON files (merged) under the "
                           "current ALPHA/FLOOR")
  args = parser.parse_args(argv)
  if args.summarize:
    records = []
    for path in args.summarize:
      opener = gzip.open if path.endswith(".gz") else open
      with opener(path, "rt") as f:
        payload = json.load(f)
      if any("floor" not in r for r in payload["records"]):
        add_floors(payload["records"])
        with opener(path, "wt") as f:
          json.dump(payload, f)
      records += payload["records"]
  else:
    records = collect(load_impl(args.impl), args.cases, BUCKETS[args.buckets], args.seed,
                      log=lambda m: print(m, flush=True))
  summary = summarize(records)
  print(f"{len(records)} records")
  print(f"{'dtype/output':18} {'n':>5} {'err/ref p50':>11} {'p99':>7} {'max':>7} "
        f"{'err/tol p50':>11} {'p99':>7} {'max':>7} {'alpha-term':>10}")
  for key, s in summary.items():
    print(f"{key:18} {s['n']:5d} {s['err_over_ref_p50']:11.2f} {s['err_over_ref_p99']:7.2f} "
          f"{s['err_over_ref_max']:7.2f} {s['err_over_tol_p50']:11.3f} "
          f"{s['err_over_tol_p99']:7.3f} {s['worst_err_over_tol']:7.3f} "
          + ("         -" if s['alpha_term_share'] is None else f"{s['alpha_term_share']:10.0%}"))
  if not args.summarize:
    with open(args.out, "w") as f:
      json.dump({"impl": args.impl, "cases": args.cases, "buckets": args.buckets,
                 "seed": args.seed, "summary": summary, "records": records}, f)


if __name__ == "__main__":
  main()
