"""Whether a change leaves the single-device call's program as it was.

``python -m benchmarks.same_lowering --base REV`` lowers the forward and
backward of ``ua_kernels.attention`` (jit of its gradient, lse included) for a
few configurations, with REV's ua_kernels (imported beside the working tree's,
benchmarks/ab.py) and with the working tree's, and compares the text. On a
machine without a GPU the kernels lower through the Pallas interpreter, whose
program holds every kernel body's operations: identical text means the call
traces the same kernels, so a change that adds a path (a keyword left at its
default) costs that call nothing. Exits 1 if any configuration differs.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from benchmarks.ab import import_revision

CONFIGS = (
    ("bfloat16", {}),
    ("bfloat16", {"causal": True}),
    ("float32", {"window_len": 9, "segments": True}),
    ("float16", {"causal": True, "cap_method": "tanh", "cap_params": (5.0,),
                 "z_loss_weight": 0.1}),
    ("float32", {"causal": True, "window_len": 17}),
)


def lowered_text(module, dtype, options, t=48) -> str:
  rng = np.random.default_rng(0)
  options = dict(options)
  q = jnp.asarray(rng.standard_normal((1, t, 4, 32)), dtype)
  k = jnp.asarray(rng.standard_normal((1, t, 2, 32)), dtype)
  seg = jnp.asarray((np.arange(t) // 10)[None], jnp.int32) if options.pop("segments", False) \
      else None

  def loss(q, k, v):
    out, lse = module.attention(q, k, v, segment_ids=seg, return_lse=True, **options)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).as_text()
  return text.replace(module.__name__, "ua_kernels")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.same_lowering",
                                   description=__doc__)
  parser.add_argument("--base", required=True, help="git revision to compare against")
  options = parser.parse_args(argv)
  base = import_revision(options.base, "ua_kernels_base")
  differ = 0
  for dtype, config in CONFIGS:
    same = lowered_text(base, jnp.dtype(dtype), config) == lowered_text(
        ua_kernels, jnp.dtype(dtype), config)
    differ += not same
    print(f"{dtype} {config}: {'identical' if same else 'DIFFERENT'}", flush=True)
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
