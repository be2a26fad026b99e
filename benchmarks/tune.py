"""Block-size sweep on the GPU: python -m benchmarks.tune --json tune.json.

For each (head dim, masking) it times the forward over forward tilings, then
forward+backward over backward tilings with the best forward, and prints the
winners; ua_kernels/tuned_configs.py records them.
"""

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from ua_kernels import KernelConfig
from benchmarks.bench import _fwd_bwd, _time

FWD = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 8, 2),
       (128, 32, 4, 3)]
BWD = [(64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2), (128, 64, 64, 128, 8, 2),
       (32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2), (32, 32, 32, 32, 4, 2)]
SHAPES = [(128, False), (128, True), (64, True), (256, True)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default="tune.json")
  parser.add_argument("--t", type=int, default=4096)
  args = parser.parse_args()
  results = []
  for d, causal in SHAPES:
    b = 4 if d <= 128 else 2
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, args.t, 16, d)), jnp.bfloat16) for _ in range(3))
    best_fwd, best = None, None
    for bq, bkv, w, s in FWD:
      cfg = KernelConfig(block_q=bq, block_kv=bkv, num_warps=w, num_stages=s)
      f = jax.jit(lambda q, k, v, cfg=cfg: ua_kernels.attention(q, k, v, causal=causal, config=cfg))
      try:
        ms = _time(f, (q, k, v), 3)
      except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory
        print(f"D{d} causal={causal} fwd {bq}x{bkv} w{w} s{s}: {type(exc).__name__}", flush=True)
        continue
      print(f"D{d} causal={causal} fwd {bq}x{bkv} w{w} s{s}: {ms:.3f} ms", flush=True)
      if best is None or ms < best:
        best_fwd, best = cfg, ms
    best_bwd, best_b = None, None
    for bqq, bkq, bqk, bkk, w, s in BWD:
      cfg = dataclasses.replace(best_fwd, block_q_dq=bqq, block_kv_dq=bkq, block_q_dkv=bqk,
                                block_kv_dkv=bkk, num_warps_bwd=w, num_stages_bwd=s)
      f = lambda q, k, v, cfg=cfg: ua_kernels.attention(q, k, v, causal=causal, config=cfg)
      try:
        ms = _time(_fwd_bwd(f), (q, k, v), 3)
      except Exception as exc:  # noqa: BLE001
        print(f"D{d} causal={causal} bwd {bqq},{bkq},{bqk},{bkk} w{w}: {type(exc).__name__}", flush=True)
        continue
      print(f"D{d} causal={causal} bwd {bqq},{bkq},{bqk},{bkk} w{w} s{s}: {ms:.3f} ms", flush=True)
      if best_b is None or ms < best_b:
        best_bwd, best_b = cfg, ms
    results.append({"head_dim": d, "causal": causal, "fwd_ms": best, "fwd_bwd_ms": best_b,
                    "config": dataclasses.asdict(best_bwd or best_fwd)})
    print("BEST", results[-1], flush=True)
  with open(args.json, "w") as f:
    json.dump(results, f, indent=1)


if __name__ == "__main__":
  main()
