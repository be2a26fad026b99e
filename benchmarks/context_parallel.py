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
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

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


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel",
                                   description=__doc__)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default="context_parallel.json")
  options = parser.parse_args(argv)
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
