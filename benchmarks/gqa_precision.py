"""The float32 GQA precision table of docs/DEFECTS.md (G1): a saved case and its
variations, error/tolerance and max |error| of out, dq, dk, dv against the oracle.

    python -m benchmarks.gqa_precision CASE.json [--t 2049] [--only NAME ...]

Runs ua_kernels.attention (compiled on a GPU, interpreted elsewhere) through the
suite's runner, so the numbers are exactly what matches_oracle compares.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from properties.model.capabilities import load_impl
from properties.model.case import load_case_file
from properties.judge.runner import Harness, evaluate

VARIATIONS = {
    "as saved": {},
    "no GQA (Hkv = Hq)": "mha",
    "no window": dict(window_len=0),
    "window 600": dict(window_len=600),
    "GQA 2->1": dict(num_q_heads=2, num_kv_heads=1),
    "GQA 8->2": dict(num_kv_heads=2),
    "no temperature, no cap": dict(temperature="none", cap_method="none", cap_params=()),
    "causal": dict(causal=True),
    "causal, no GQA": ("mha", dict(causal=True)),
    "bfloat16": dict(dtype="bfloat16"),
    "float16": dict(dtype="float16"),
    "bfloat16, no GQA": ("mha", dict(dtype="bfloat16")),
    "float16, no GQA": ("mha", dict(dtype="float16")),
}


def variant(case, change):
  mha = change == "mha" or (isinstance(change, tuple) and change[0] == "mha")
  if isinstance(change, tuple):
    change = change[1]
  if mha:
    case = dataclasses.replace(case, num_kv_heads=case.num_q_heads)
  return dataclasses.replace(case, **(change if isinstance(change, dict) else {}))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("case_file")
  parser.add_argument("--t", type=int, default=None, help="sequence length (default: the file's)")
  parser.add_argument("--only", nargs="*", default=None, help="variation names")
  parser.add_argument("--impl", default="ua_kernels:attention")
  args = parser.parse_args(argv)
  base = load_case_file(args.case_file)["case"]
  if args.t:
    base = dataclasses.replace(base, seq_len=args.t)
  impl = load_impl(args.impl)
  print(f"{'variation':26} {'T':>5} " + " ".join(f"{n:>18}" for n in ("out", "dq", "dk", "dv")))
  for name, change in VARIATIONS.items():
    if args.only and name not in args.only:
      continue
    case = variant(base, change)
    start = time.time()
    errors = {e.name: e for e in Harness.of(case).score(evaluate(impl, case))}
    cells = " ".join(f"{errors[n].ratio:7.3f} ({errors[n].max_abs_err:7.1e})"
                     for n in ("out", "dq", "dk", "dv"))
    print(f"{name:26} {case.seq_len:5d} {cells}  {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
