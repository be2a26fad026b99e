"""The context-parallel op over one device against the plain call, in one process.

``python -m benchmarks.context_parallel --json FILE`` times, round-robin
(bench.time_interleaved), forward and forward+backward of:

- ``plain``: ``ua_kernels.attention``;
- ``op P=1``: ``context_parallel.attention`` over a one-device mesh (the op's
  own P = 1 path);
- ``ring P=1``: the ring itself over that mesh (two zig-zag chunks on the one
  device, their pair calls and the lse merge): what one device pays for the
  ring's structure, a lower bound of its per-device overhead at P > 1 before
  any communication (docs/CONTEXT_PARALLEL.md).

``--compile`` instead times lowering and compiling the forward+backward over 2
and 4 devices (on the CPU: ``XLA_FLAGS=--xla_force_host_platform_device_count=4``),
small shapes, causal without and with key blocks: the size of the ring's program,
which is what the suite's CPU runs of the sharded op pay for (docs/CONTEXT_PARALLEL.md).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

import ua_kernels
from benchmarks.bench import fwd_and_grad_times, provenance
from ua_kernels import context_parallel
from ua_reference.contract import validate

# (label, B, T, Hq, Hkv, D, causal, window, documents of this length or 0)
CASES = (
    ("full", 4, 4096, 16, 16, 128, False, 0, 0),
    ("causal", 4, 4096, 16, 16, 128, True, 0, 0),
    ("causal window 1024", 4, 4096, 16, 16, 128, True, 1024, 0),
    ("causal documents of 512", 4, 4096, 16, 16, 128, True, 0, 512),
)


def _ring(q, k, v, mesh, segment_ids=None, **kw):
  spec, segment_ids, temperature = validate(q, k, v, segment_ids=segment_ids, **kw)
  return context_parallel._ring_attention(
      q, k, v, mesh=mesh, axis="context", spec=spec, segment_ids=segment_ids,
      causal=kw.get("causal", False), cap_method="none", cap_params=(), temperature=None,
      z_loss_weight=0.0, return_lse=False, config=None)


def compile_rows(shard_counts=(2, 4)) -> list[dict]:
  """Seconds to lower and to compile jit(value_and_grad) of the op, B1 T64 H4 D32
  bfloat16, causal alone and with a window of 12 and four documents."""
  rows = []
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 64, 4, 32)), jnp.bfloat16) for _ in range(3))
  seg = jnp.asarray(np.repeat(np.arange(4), 16)[None], jnp.int32)
  for shards in shard_counts:
    mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
    for label, kw in (("causal", dict(causal=True)),
                      ("causal, window 12, documents",
                       dict(causal=True, window_len=12, segment_ids=seg))):
      def loss(q, k, v, kw=kw):
        out, lse = context_parallel.attention(q, k, v, mesh=mesh, axis="context",
                                              return_lse=True, **kw)
        return out.astype(jnp.float32).sum() + lse.sum()
      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
      start = time.perf_counter()
      lowered = fn.lower(q, k, v)
      lowered_at = time.perf_counter()
      lowered.compile()
      row = {"shards": shards, "case": label, "lower_s": round(lowered_at - start, 2),
             "compile_s": round(time.perf_counter() - lowered_at, 2)}
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel",
                                   description=__doc__)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default="context_parallel.json")
  parser.add_argument("--compile", action="store_true",
                      help="time lowering and compiling over 2 and 4 devices instead")
  options = parser.parse_args(argv)
  if options.compile:
    result = {**provenance(argv), "rows": compile_rows()}
    pathlib.Path(options.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0
  if options.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {options.repeats}")
  mesh = Mesh(np.array(jax.devices()[:1]), ("context",))
  result = {**provenance(argv), "rows": []}
  for label, b, t, hq, hkv, d, causal, window, doc in CASES:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16) for h in (hq, hkv, hkv))
    seg = None if not doc else jnp.asarray(np.broadcast_to(np.arange(t) // doc, (b, t)),
                                           jnp.int32)
    kw = dict(causal=causal, window_len=window)
    fns = {"plain": lambda q, k, v, seg: ua_kernels.attention(q, k, v, segment_ids=seg, **kw),
           "op P=1": lambda q, k, v, seg: context_parallel.attention(
               q, k, v, mesh=mesh, axis="context", segment_ids=seg, **kw),
           "ring P=1": lambda q, k, v, seg: _ring(q, k, v, mesh, segment_ids=seg, **kw)}
    row = {"case": f"B{b} T{t} H{hq}/{hkv} D{d} bfloat16 {label}",
           **fwd_and_grad_times(fns, (q, k, v, seg), options.repeats, base="plain")}
    print(json.dumps(row), flush=True)
    result["rows"].append(row)
  pathlib.Path(options.json).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
