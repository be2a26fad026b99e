"""tokamax 0.0.17: dot_product_attention raises under jax_enable_x64.

Standalone: tokamax, jax and numpy only. On one H200 (jax 0.11.2, CUDA 13):

  python tokamax-x64.py

With x64 enabled, tokamax's kernels mix int64 Python-int arithmetic with int32 indices
and lax.div refuses the pair. Prints, for each implementation and shape, whether the
forward and its vjp ran or the exception; exits 1 if a call raised under x64 that ran
without it.
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


def call(x64, t=1000, dtype="bfloat16", implementation="mosaic", causal=False):
  jax.config.update("jax_enable_x64", x64)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, h, 128)), dtype) for h in (8, 2, 2))
  try:
    out, vjp = jax.vjp(lambda q, k, v: tokamax.dot_product_attention(
        q, k, v, is_causal=causal, implementation=implementation), q, k, v)
    jax.block_until_ready(vjp(out))
    return "ran"
  except Exception as exc:  # noqa: BLE001
    return f"raised {type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
  import importlib.metadata as md
  print(f"tokamax {md.version('tokamax')}, jax {jax.__version__}, "
        f"{jax.devices()[0].device_kind}", flush=True)
  failed = False
  for kw in (dict(), dict(t=1024), dict(causal=True), dict(implementation="triton")):
    without, with_x64 = call(False, **kw), call(True, **kw)
    print(f"{kw}: without x64 {without}; with x64 {with_x64}", flush=True)
    failed |= without == "ran" and with_x64 != "ran"
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
