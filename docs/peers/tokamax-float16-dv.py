"""tokamax 0.0.17: float16 attention's dv is not finite for some sequence lengths.

Standalone: tokamax, jax and numpy only. On one H200 (jax 0.11.2, CUDA 13):

  python tokamax-float16-dv.py            # the reported case, then a sweep of lengths and shapes
  python tokamax-float16-dv.py shapes     # the reported case and the shapes only

For each (implementation, dtype, T, heads, head dim) it prints whether out, dq,
dk and dv of ``jax.vjp(tokamax.dot_product_attention)`` are finite, for
standard-normal q, k, v and output cotangent (seed 0). Exits 1 if any float16
dv is not finite.
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
import tokamax  # noqa: E402


def finite(t, hq=8, hkv=2, d=128, dtype="float16", implementation="mosaic", causal=False):
  rng = np.random.default_rng(0)
  q, k, v, dout = (jnp.asarray(rng.standard_normal(s), dtype) for s in (
      (1, t, hq, d), (1, t, hkv, d), (1, t, hkv, d), (1, t, hq, d)))
  attend = lambda q, k, v: tokamax.dot_product_attention(
      q, k, v, is_causal=causal, implementation=implementation)
  out, vjp = jax.vjp(attend, q, k, v)
  dq, dk, dv = vjp(dout)
  return {n: bool(jnp.isfinite(x).all()) for n, x in
          (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))}


def report(**kw):
  flags = finite(**kw)
  bad = [n for n, ok in flags.items() if not ok]
  print(f"{kw}: {'not finite: ' + ', '.join(bad) if bad else 'all finite'}", flush=True)
  return not flags["dv"] and kw.get("dtype", "float16") == "float16"


def main() -> int:
  import importlib.metadata as md
  print(f"tokamax {md.version('tokamax')}, jax {jax.__version__}, "
        f"jaxlib {md.version('jaxlib')}, {jax.devices()[0].device_kind}", flush=True)
  failed = report(t=1000)  # the reported case: B=1, T=1000, Hq=8, Hkv=2, D=128
  lengths = () if sys.argv[1:] == ["shapes"] else (
      1, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 999, 1023, 1024, 1025)
  for t in lengths:
    failed |= report(t=t)
  for kw in (dict(t=1000, hq=1, hkv=1), dict(t=1000, hq=1, hkv=1, d=64),
             dict(t=1000, causal=True), dict(t=1000, dtype="bfloat16"),
             dict(t=1000, implementation="triton"), dict(t=129, implementation="triton"),
             dict(t=1024, implementation="triton"), dict(t=129, causal=True),
             dict(t=129, hq=16, hkv=16, d=256)):
    failed |= report(**kw)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
