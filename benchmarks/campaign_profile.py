"""Where a campaign's seconds go, one configuration at a time.

Draws configurations as the gpu profile's ``matches_oracle`` does and times, in
one process with nothing else running, each step a campaign case pays: the
inputs, the implementation's jitted VJP and plain call (tracing and lowering,
XLA's compile, the first run, which for a Mosaic GPU kernel includes building
its module, and a second run), the float64 oracle's and the same-precision
reference's (lower, compile, run), and the comparison (scores and bias). Then
the profile's further input seeds of the same configuration, each a whole
``matches_oracle`` check. Steps are timed with explicit ahead-of-time calls
(``jit(...).lower``, ``.compile``), so nothing is attributed by guesswork.

Usage (on the GPU machine, from the repository root)::

  python -m benchmarks.campaign_profile --configs 24 --json profile.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time

import jax
from hypothesis import HealthCheck, Phase, given, settings

from properties.checks import checks

from properties.judge import runner
from properties.judge.error_terms import harness_compiler_options
from properties.model.capabilities import load_impl
from properties.model.inputs import make_inputs
from properties.model.profiles import BUCKETS, PROFILES
from properties.model.strategies import cases


def draw_configurations(impl, n: int, seed: int, profile: str = "gpu") -> list:
  """The first ``n`` configurations Hypothesis draws for matches_oracle, as in a
  campaign (derandomized by ``seed``)."""
  drawn = []

  @settings(max_examples=n, derandomize=False, database=None, deadline=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck))
  @given(case=cases(BUCKETS[profile], impl))
  def collect(case):
    drawn.append(case)

  from hypothesis import seed as hypothesis_seed
  hypothesis_seed(seed)(collect)()
  return drawn[:n]


def _timed(fn, *args):
  start = time.perf_counter()
  out = fn(*args)
  jax.block_until_ready(out)
  return out, time.perf_counter() - start


def _aot_steps(fn, args, compiler_options=None) -> dict:
  """Seconds of lower, compile, first and second run of ``jax.jit(fn)``."""
  lowered, lower_s = _timed(jax.jit(fn).lower, *args)
  compiled, compile_s = _timed(lambda: lowered.compile(compiler_options=compiler_options))
  _, first_s = _timed(compiled, *args)
  _, second_s = _timed(compiled, *args)
  return {"lower": lower_s, "compile": compile_s, "first_run": first_s, "run": second_s}


def profile_configuration(impl, case, seeds: int) -> dict:
  row = {"case": case.to_dict()}
  inputs, row["inputs"] = _timed(make_inputs, case)
  args = runner._args(inputs, float64=False)
  row["impl_vjp"] = _aot_steps(runner._vjp_fn(impl, case), args)
  row["impl_plain"] = _aot_steps(runner._forward_fn(impl, case), args[:5])
  with_lse = dataclasses.replace(case, return_lse=True, tiles=None)
  for name, float64 in (("oracle", True), ("reference", False)):
    with runner.x64(True):
      ref_args = runner._reference_args(case, inputs, float64)
      row[name] = _aot_steps(runner._vjp_fn(runner.REFERENCE, with_lse), ref_args,
                             harness_compiler_options(float64))
  # The whole check on this seed, everything compiled (runner's executables warm up
  # on the first call, so it runs twice and the second is kept; each builds its harness).
  checks.matches_oracle(impl, case)
  _, row["check_warm"] = _timed(checks.matches_oracle, impl, case)
  row["more_seeds"] = []
  for i in range(1, seeds):
    seeded = dataclasses.replace(case, seed=(case.seed + 7919 * i) % 2 ** 31)
    _, seconds = _timed(checks.matches_oracle, impl, seeded)
    row["more_seeds"].append(seconds)
  return row


def summarize(rows: list[dict]) -> dict:
  total = collections.Counter()
  for row in rows:
    total["inputs"] += row["inputs"]
    for part in ("impl_vjp", "impl_plain", "oracle", "reference"):
      for step, seconds in row[part].items():
        total[f"{part}.{step}"] += seconds
    total["check_warm"] += row["check_warm"]
    total["more_seeds"] += sum(row["more_seeds"])
  return {k: round(v, 2) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--impl", default="ua_kernels:attention")
  parser.add_argument("--configs", type=int, default=24)
  parser.add_argument("--profile", default="gpu", choices=sorted(BUCKETS))
  parser.add_argument("--seeds", type=int, default=PROFILES["gpu"].seeds)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--minutes", type=float, default=None,
                      help="stop starting configurations after this long")
  parser.add_argument("--json", default=None)
  args = parser.parse_args(argv)
  impl = load_impl(args.impl)
  configs = draw_configurations(impl, args.configs, args.seed, args.profile)
  start, rows = time.time(), []
  for case in configs:
    if args.minutes is not None and time.time() - start > 60 * args.minutes:
      break
    try:
      row = profile_configuration(impl, case, args.seeds)
    except Exception as exc:  # noqa: BLE001 -- a profile records what failed and goes on
      row = {"case": case.to_dict(), "error": f"{type(exc).__name__}: {str(exc)[:500]}"}
      print(json.dumps(row), flush=True)
      continue
    rows.append(row)
    short = {k: (round(v, 3) if isinstance(v, float) else
                 {s: round(x, 3) for s, x in v.items()} if isinstance(v, dict) and k != "case"
                 else None) for k, v in row.items() if k not in ("case", "more_seeds")}
    c = case
    print(f"T{c.seq_len} B{c.batch} H{c.num_q_heads}/{c.num_kv_heads} D{c.head_dim} {c.dtype} "
          f"{sorted(c.features())} {c.cap_method}: {json.dumps(short)} "
          f"seeds {[round(s, 3) for s in row['more_seeds']]}", flush=True)
  summary = {"configurations": len(rows), "seconds": round(time.time() - start, 1),
             "by_step": summarize(rows)}
  print(json.dumps(summary, indent=1))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"summary": summary, "rows": rows, "jax": jax.__version__,
                 "devices": [str(d) for d in jax.devices()]}, f, indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
