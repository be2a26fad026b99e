"""Calibrates the tolerance model from data: python -m properties.calibrate.

Runs N random cases of an implementation believed correct, records for each
output its error against the float64 oracle, the same-precision reference's
error and the floor scale, then prints per (dtype, output) the distribution of
err_impl / err_ref, the worst error/tolerance ratio under the current ALPHA and
FLOOR, and writes everything as JSON (for docs/TOLERANCES.md).
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

from .capabilities import load_impl
from .runner import baseline, evaluate
from .profiles import BUCKETS
from .strategies import cases
from .tolerance import ALPHA, FLOOR, OUTPUTS


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
    oracle, bounds = baseline(case)
    for name in OUTPUTS:
      if result.get(name) is None or name not in bounds:
        continue
      x, o = np.asarray(result[name], np.float64), np.asarray(oracle[name], np.float64)
      finite = np.isfinite(o)
      err = float(np.max(np.where(finite & np.isfinite(x), np.abs(x - o), 0), initial=0))
      nonfinite = int((~np.isfinite(x) & finite).sum() + np.isnan(x).sum())
      ref_err, floor = bounds[name]
      records.append({"dtype": case.dtype, "output": name, "err": err, "ref_err": ref_err,
                      "floor": floor, "nonfinite": nonfinite, "case": case.to_dict()})
    if len(records) % 50 < 5:
      log(f"{len(records)} records, {time.time() - start:.0f} s")

  run()
  return records


def add_floors(records) -> None:
  """Fills in ``floor`` for records saved before the floor model changed
  (recomputes each case's oracle and floors; errors are kept as measured)."""
  from .case import Case
  cache = {}
  for r in records:
    if "floor" in r:
      continue
    case = Case.from_dict(r["case"])
    if case not in cache:
      cache[case] = {name: floor for name, (_, floor) in baseline(case)[1].items()}
    r["floor"] = cache[case][r["output"]]


def summarize(records) -> dict:
  groups = collections.defaultdict(list)
  for r in records:
    groups[(r["dtype"], r["output"])].append(r)
  summary = {}
  for (dtype, name), rows in sorted(groups.items()):
    err = np.array([r["err"] for r in rows])
    ref = np.array([r["ref_err"] for r in rows])
    floor = np.array([r["floor"] for r in rows])
    ratio_ref = err / np.maximum(ref, floor)   # impl error in units of reference error
    tol = ALPHA[name] * ref + floor
    ratio_tol = np.where(tol > 0, err / np.where(tol > 0, tol, 1), np.where(err > 0, np.inf, 0))
    summary[f"{dtype}/{name}"] = {
        "n": len(rows),
        "err_over_ref_p50": float(np.percentile(ratio_ref, 50)),
        "err_over_ref_p90": float(np.percentile(ratio_ref, 90)),
        "err_over_ref_p99": float(np.percentile(ratio_ref, 99)),
        "err_over_ref_max": float(ratio_ref.max()),
        "worst_err_over_tol": float(ratio_tol.max()),
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
  print(f"{'dtype/output':18} {'n':>5} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>8} "
        f"{'alpha':>6} {'worst err/tol':>13}")
  for key, s in summary.items():
    print(f"{key:18} {s['n']:5d} {s['err_over_ref_p50']:7.2f} {s['err_over_ref_p90']:7.2f} "
          f"{s['err_over_ref_p99']:7.2f} {s['err_over_ref_max']:8.2f} {s['alpha']:6.1f} "
          f"{s['worst_err_over_tol']:13.3f}")
  if not args.summarize:
    with open(args.out, "w") as f:
      json.dump({"impl": args.impl, "cases": args.cases, "buckets": args.buckets,
                 "seed": args.seed, "summary": summary, "records": records}, f)


if __name__ == "__main__":
  main()
