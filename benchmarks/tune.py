"""Block-size sweep on the GPU: python -m benchmarks.tune --json tune.json.

For each (head dim, masking, cap) it times the forward over forward tilings,
then (unless --fwd-only) forward+backward over backward tilings with the best
forward. ``--backend mosaic`` sweeps the Mosaic GPU kernels' MosaicTiles
instead (Hopper only). Candidates of one sweep are timed round-robin (bench.time_interleaved),
so their ranking survives clock drift. ua_kernels/triton/tuned.py and mosaic/tuned.py record the
winners. The JSON holds bench.provenance()'s fields (commit, command, versions,
GPU, date) and "rows", the best configuration per shape.
"""

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from ua_kernels import KernelConfig, MosaicTiles
from ua_kernels.mosaic import backward as mosaic_backward
from ua_kernels.tuned_configs import effective_config
from ua_reference.contract import validate
from benchmarks.bench import _fwd_bwd, provenance, time_interleaved

FWD = [(128, 64, 8, 3), (128, 128, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
       (64, 128, 4, 2), (128, 64, 8, 2), (128, 32, 4, 3)]
BWD = [(64, 64, 64, 64, 8, 2), (64, 64, 64, 64, 4, 2), (128, 64, 64, 128, 8, 2),
       (32, 64, 64, 32, 4, 2), (64, 128, 128, 64, 8, 2), (32, 32, 32, 32, 4, 2)]
# MosaicTiles: (block_q, block_kv, stages) of the forward; (block_q_dq,
# block_kv_dq, block_q_dkv, block_kv_dkv, stages_bwd) of the backward. Larger
# backward tiles need more than the 232 registers per thread of a compute
# warpgroup at head dim 128 (dk and dv alone take 128 for 64 keys).
MOSAIC_FWD = [(64, None, 2), (64, 128, 3), (64, 64, 2), (64, 256, 2)]
MOSAIC_BWD = [(64, 64, 64, 64, 2), (64, 128, 64, 64, 2), (64, 64, 64, 64, 3),
              (64, 64, 128, 64, 2)]
# float32 (Pallas-Triton only, precision HIGHEST: FMA products, no tensor
# cores): smaller tiles, whose unrolled products compile in seconds, not tens.
FWD_F32 = [(32, 32, 4, 2), (32, 32, 4, 3), (64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 2),
           (64, 64, 4, 3)]
BWD_F32 = [(32, 32, 32, 32, 4, 2), (32, 32, 32, 32, 8, 2), (32, 32, 32, 32, 4, 1),
           (64, 32, 32, 64, 4, 2), (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2)]
# (head dim, causal, tanh cap)
SHAPES = [(128, False, 0.0), (128, True, 0.0), (128, False, 30.0), (128, True, 30.0),
          (64, True, 0.0), (256, True, 0.0)]
SHAPES_F32 = [(64, True, 0.0), (128, False, 0.0), (128, True, 0.0), (256, True, 0.0)]


def _label(cfg_tuple):
  return " ".join(str(x) for x in cfg_tuple)


def _report_best(prefix, times):
  """Prints each candidate's time (or its failure) and returns (name, ms) of the fastest."""
  for n, ms in times.items():
    print(f"{prefix} {n}: " + (f"{ms:.3f} ms" if isinstance(ms, float) else type(ms).__name__),
          flush=True)
  timed = {n: ms for n, ms in times.items() if isinstance(ms, float)}
  if not timed:
    raise RuntimeError(f"{prefix}: no candidate ran")
  best = min(timed, key=timed.get)
  return best, timed[best]


def _compiled(fns, args):
  """({name: compiled executable}, {name: compile seconds or the exception})."""
  executables, seconds = {}, {}
  for name, fn in fns.items():
    start = time.perf_counter()
    try:
      executables[name] = fn.lower(*args).compile()
      seconds[name] = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 -- a tiling whose shared memory does not fit
      seconds[name] = exc
  return executables, seconds


def _sweep(name, fns, args, repeats):
  """(best name, its ms, {candidate: compile seconds}): each candidate compiled
  (timed) and then timed round-robin."""
  executables, compile_s = _compiled(fns, args)
  times = {n: exc for n, exc in compile_s.items() if not isinstance(exc, float)}
  times.update(time_interleaved(executables, args, repeats))
  for n, s in compile_s.items():
    if isinstance(s, float):
      print(f"{name} {n}: compiled in {s:.2f} s", flush=True)
  best, best_ms = _report_best(name, times)
  return best, best_ms, {n: s for n, s in compile_s.items() if isinstance(s, float)}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default="tune.json")
  parser.add_argument("--t", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--head-dims", default="64,128,256")
  parser.add_argument("--fwd-only", action="store_true")
  parser.add_argument("--backend", default="triton", choices=("triton", "mosaic"))
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
  parser.add_argument("--batch", type=int, default=None,
                      help="batch (default 4, 2 at head dim 256)")
  args = parser.parse_args()
  if args.batch is not None and args.batch < 1:
    parser.error(f"--batch must be at least 1, got {args.batch}")
  f32 = args.dtype == "float32"
  if f32 and args.backend == "mosaic":
    parser.error("--dtype float32 runs on Triton only (the Mosaic kernels are 16-bit)")
  header = provenance()
  dims = {int(d) for d in args.head_dims.split(",")}
  results = []
  for d, causal, cap in [s for s in (SHAPES_F32 if f32 else SHAPES) if s[0] in dims]:
    b = args.batch if args.batch is not None else (4 if d <= 128 else 2)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, args.t, 16, d)), args.dtype) for _ in range(3))
    kw = dict(causal=causal, **(dict(cap_method="tanh", cap_params=(cap,)) if cap else {}))
    name = f"{args.dtype} D{d} causal={causal} cap={cap:g}"

    def attention_with(cfg):
      return lambda q, k, v: ua_kernels.attention(q, k, v, config=cfg, **kw)

    if args.backend == "mosaic":
      fwd_cfgs = {_label(c): KernelConfig(backend="mosaic", mosaic=MosaicTiles(
          block_q=c[0], block_kv=c[1], stages=c[2])) for c in MOSAIC_FWD}
    else:
      fwd_cfgs = {_label(c): KernelConfig(backend="triton", block_q=c[0], block_kv=c[1],
                                          num_warps=c[2], num_stages=c[3])
                  for c in (FWD_F32 if f32 else FWD)}
    # Fields a candidate leaves unset are the tuned table's; filled here so that
    # the rows record every value that ran.
    spec = validate(q, k, v, **kw)[0]
    fwd_cfgs = {n: effective_config(spec, q.dtype, c) for n, c in fwd_cfgs.items()}
    best, best_ms, compile_s = _sweep(
        f"{name} fwd", {n: jax.jit(attention_with(c)) for n, c in fwd_cfgs.items()}, (q, k, v),
        args.repeats)
    row = {"dtype": args.dtype, "head_dim": d, "causal": causal, "cap": cap, "fwd_ms": best_ms,
           "config": dataclasses.asdict(fwd_cfgs[best]), "fwd_compile_s": compile_s}
    if not args.fwd_only:
      if args.backend == "mosaic":
        forward_tiles = fwd_cfgs[best].mosaic
        bwd_cfgs = {_label(c): dataclasses.replace(fwd_cfgs[best], mosaic=dataclasses.replace(
            forward_tiles, block_q_dq=c[0], block_kv_dq=c[1], block_q_dkv=c[2],
            block_kv_dkv=c[3], stages_bwd=c[4])) for c in MOSAIC_BWD}
        # Above head dim 128 some tiles do not fit the halves kernels (the
        # dispatch runs those on Triton) and key tiles over 64 are the same
        # kernel as 64: time only what runs on Mosaic, once.
        effective = {}
        for n, c in bwd_cfgs.items():
          if mosaic_backward.unsupported(spec, q.dtype, c.mosaic) is None:
            key = (dataclasses.replace(c.mosaic, block_kv_dq=min(c.mosaic.block_kv_dq, 64))
                   if d > mosaic_backward.HALVES_ABOVE else c.mosaic)
            effective.setdefault(key, n)
        bwd_cfgs = {n: bwd_cfgs[n] for n in effective.values()}
      else:
        bwd_cfgs = {_label(c): dataclasses.replace(
            fwd_cfgs[best], block_q_dq=c[0], block_kv_dq=c[1], block_q_dkv=c[2],
            block_kv_dkv=c[3], num_warps_bwd=c[4], num_stages_bwd=c[5])
            for c in (BWD_F32 if f32 else BWD)}
      best_b, best_b_ms, compile_s = _sweep(
          f"{name} fwd+bwd", {n: _fwd_bwd(attention_with(c)) for n, c in bwd_cfgs.items()},
          (q, k, v), args.repeats)
      row.update(fwd_bwd_ms=best_b_ms, config=dataclasses.asdict(bwd_cfgs[best_b]),
                 fwd_bwd_compile_s=compile_s)
    results.append(row)
    print("BEST", row, flush=True)
    with open(args.json, "w") as f:  # after every shape: a sweep cut short keeps its rows
      json.dump({**header, "rows": results}, f, indent=1)


if __name__ == "__main__":
  main()
