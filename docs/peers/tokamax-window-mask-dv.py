"""tokamax 0.0.17: a window (k_start) and a dense mask together give a wrong dv; a negative
logits scale gives NaN.

Standalone: tokamax, jax and numpy only. On one H200 (jax 0.11.2, CUDA 13):

  python tokamax-window-mask-dv.py

1. bfloat16, B=1, T=1000, Hq=2, Hkv=1, D=128: documents of random lengths as a dense
   [B,1,T,T] mask, and a left window of 128 keys as ``Mask(k_start=max(0, i-127))``, both
   handed to tokamax's Mosaic flash attention (``PallasMosaicGpuFlashAttention``) at once;
   then the same visible set as one dense mask alone. dv of each is compared with XLA's
   float32 ``jax.nn.dot_product_attention`` under the combined dense mask: the largest
   error, in units of max |dv|, and the number of (key, dim) elements off by more than 5%.
2. The same op with ``logits_scale`` = +-1/sqrt(128) at several T (one head): are out and
   the vjp's dq, dk, dv finite?
Exits 1 if either shows the defect.
"""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np


def _stub_xprof():
  """tokamax imports xprof (its benchmarking) at import time; attention never uses it."""
  try:
    import xprof.cli.tools  # noqa: F401
  except ImportError:
    tools = types.ModuleType("xprof.cli.tools")
    tools.get_kernel_stats_tool = lambda *a, **k: None
    cli, pkg = types.ModuleType("xprof.cli"), types.ModuleType("xprof")
    pkg.__path__, cli.__path__, pkg.cli, cli.tools = [], [], cli, tools
    sys.modules.update({"xprof": pkg, "xprof.cli": cli, "xprof.cli.tools": tools})


_stub_xprof()
from tokamax._src.ops.attention import base  # noqa: E402
from tokamax._src.ops.attention import pallas_mosaic_gpu as mgpu  # noqa: E402


def documents(rng, t):
  ids, doc = [], 0
  while len(ids) < t:
    ids += [doc] * int(rng.integers(1, 300))
    doc += 1
  return np.asarray(ids[:t])


def attend(op, **kw):
  """The op's output alone (the Op API may return (out, residuals))."""
  def f(q, k, v):
    result = op(q, k, v, **kw)
    return result[0] if isinstance(result, tuple) else result
  return f


def dv_of(op, q, k, v, dout, mask, scale):
  _, vjp = jax.vjp(attend(op, logits_scale=scale, mask=mask), q, k, v)
  return np.asarray(vjp(dout)[2], np.float32)


def window_and_dense_mask(t=1000, window=128, hq=2, hkv=1, d=128):
  rng = np.random.default_rng(0)
  q, dout = (jnp.asarray(rng.standard_normal((1, t, hq, d)), jnp.bfloat16) for _ in range(2))
  k, v = (jnp.asarray(rng.standard_normal((1, t, hkv, d)), jnp.bfloat16) for _ in range(2))
  # T padded to a multiple of 64 for the dense mask's TMA loads, as tokamax's VJP needs;
  # padded queries see only their own (zero) key.
  tp = -(-t // 64) * 64
  pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
  q, k, v, dout = pad(q), pad(k), pad(v), pad(dout)
  seg = documents(rng, t)
  i = np.arange(tp)
  real = i < t
  same = np.zeros((tp, tp), bool)
  same[:t, :t] = seg[:, None] == seg[None, :]
  same |= (i[:, None] == i[None, :]) & ~real[:, None]
  in_window = i[None, :] > i[:, None] - window
  combined = same & (in_window | ~real[:, None])
  k_start = jnp.maximum(jnp.arange(tp, dtype=jnp.int32) - (window - 1), 0)
  scale = d ** -0.5
  op = mgpu.PallasMosaicGpuFlashAttention()
  both = dv_of(op, q, k, v, dout, base.Mask(k_start=k_start) & base.Mask(jnp.asarray(same)[None, None]), scale)
  dense = dv_of(op, q, k, v, dout, base.Mask(jnp.asarray(combined)[None, None]), scale)
  ref_fn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=jnp.asarray(combined)[None, None], scale=scale, implementation="xla")
  f32 = lambda x: x.astype(jnp.float32)
  _, vjp = jax.vjp(ref_fn, f32(q), f32(jnp.repeat(k, hq // hkv, 2)), f32(jnp.repeat(v, hq // hkv, 2)))
  ref = np.asarray(vjp(f32(dout))[2]).reshape(1, tp, hkv, hq // hkv, d).sum(3)
  bad = False
  for name, dv in (("window k_start & dense mask", both), ("one dense mask", dense)):
    err = np.abs(dv[:, :t] - ref[:, :t])
    top = float(np.abs(ref[:, :t]).max())
    off = int((err > 0.05 * top).sum())
    print(f"T={t} window {window} documents, {name}: max |dv error| / max |dv| = "
          f"{err.max() / top:.3g}, elements off by > 5%: {off}", flush=True)
    bad |= name.startswith("window") and off > 0
  return bad


def negative_scale(t, d=128):
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.standard_normal((1, t, 1, d)), jnp.bfloat16) for _ in range(4))
  op = mgpu.PallasMosaicGpuFlashAttention()
  flags = {}
  for scale in (d ** -0.5, -(d ** -0.5)):
    out, vjp = jax.vjp(attend(op, logits_scale=scale), q, k, v)
    flags[scale] = [n for n, x in zip(("out", "dq", "dk", "dv"), (out, *vjp(dout)))
                    if not bool(jnp.isfinite(x.astype(jnp.float32)).all())]
  print(f"T={t} D={d} bfloat16: not finite with scale +{d ** -0.5:.4f}: {flags[d ** -0.5] or 'none'}; "
        f"with scale -{d ** -0.5:.4f}: {flags[-(d ** -0.5)] or 'none'}", flush=True)
  return bool(flags[-(d ** -0.5)])


def main() -> int:
  import importlib.metadata as md
  print(f"tokamax {md.version('tokamax')}, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}", flush=True)
  bad = window_and_dense_mask()
  for t in (1, 64, 65, 1000, 1024):
    bad |= negative_scale(t)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
