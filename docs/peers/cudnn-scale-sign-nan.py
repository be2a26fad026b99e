"""cuDNN through jax.nn.dot_product_attention: are outputs finite for a negative ``scale``?

Standalone: jax and numpy only. On one H200 (jax 0.11.2, CUDA 13):

  python cudnn-scale-sign-nan.py

This project's exact-mask property found every output element of cuDNN not finite on a
case with scale = -1/sqrt(128); the script sweeps the sign of ``scale`` over two kinds of
inputs.

The inputs are those of this project's exact-mask property (properties/checks/mask_check.py):
batch row r checks key chunk [r*D, (r+1)*D); there key r*D + e has k = v = e_e (all other
keys zero) and query r*D + e has q = e_e / 8 (all other queries zero). Every logit is 0 but
the chunk's diagonal (D^-0.5 / 8), so every probability is positive and finite, and out,
dq, dk, dv are finite. For each variant it prints which of out and the vjp's dq, dk, dv hold
a non-finite element, for implementation="cudnn" and, as a control, "xla"; then the same
for standard-normal inputs.
Exits 1 if cuDNN gives a non-finite output where XLA does not.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np


def one_hot_inputs(t, hq, hkv, d, dtype, rows=None):
  rows = rows if rows is not None else -(-t // d)
  q = np.zeros((rows, t, hq, d), np.float32)
  k = np.zeros((rows, t, hkv, d), np.float32)
  for r in range(rows):
    pos = np.arange(r * d, min((r + 1) * d, t))
    q[r, pos, :, pos - r * d] = 1.0 / 8
    k[r, pos, :, pos - r * d] = 1.0
  dout = np.zeros((rows, t, hq, d), np.float32)
  for r in range(rows):
    pos = np.arange(r * d, min((r + 1) * d, t))
    dout[r, pos, :, pos - r * d] = 1.0
  return tuple(jnp.asarray(x, dtype) for x in (q, k, k.copy(), dout))


def non_finite(implementation, q, k, v, dout, causal, scale=None):
  attend = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, scale=scale, is_causal=causal, implementation=implementation)
  try:
    out, vjp = jax.vjp(attend, q, k, v)
    grads = vjp(dout)
  except Exception as exc:  # noqa: BLE001 -- report and go on
    return f"raised {type(exc).__name__}: {str(exc)[:200]}"
  bad = [n for n, x in zip(("out", "dq", "dk", "dv"), (out, *grads))
         if not bool(jnp.isfinite(x.astype(jnp.float32)).all())]
  return "not finite: " + ", ".join(bad) if bad else "all finite"


def main() -> int:
  import importlib.metadata as md
  print(f"jax {jax.__version__}, jaxlib {md.version('jaxlib')}, {jax.devices()[0].device_kind}",
        flush=True)
  worse = False
  rng = np.random.default_rng(0)
  for t, hq, hkv, d, dtype, causal in ((1000, 8, 1, 128, "bfloat16", False),
                                       (1024, 8, 1, 128, "bfloat16", False),
                                       (1000, 8, 1, 128, "float16", True),
                                       (128, 1, 1, 64, "bfloat16", False)):
    sparse = one_hot_inputs(t, hq, hkv, d, dtype, rows=1)
    normal = tuple(jnp.asarray(rng.standard_normal(x.shape), dtype) for x in sparse)
    for scale in (None, d ** -0.5, -(d ** -0.5)):
      for kind, args in (("one-hot", sparse), ("normal", normal)):
        cudnn, xla = (non_finite(i, *args, causal, scale) for i in ("cudnn", "xla"))
        print(f"T={t} heads {hq}/{hkv} D={d} {dtype} causal={causal} scale={scale} {kind}: "
              f"cudnn {cudnn}; xla {xla}", flush=True)
        worse |= cudnn.startswith("not finite") and not xla.startswith("not finite")
  return 1 if worse else 0


if __name__ == "__main__":
  sys.exit(main())
