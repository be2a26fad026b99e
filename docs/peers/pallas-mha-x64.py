"""jax's Pallas-Triton mha (jax.experimental.pallas.ops.gpu.attention): which calls raise
under jax_enable_x64.

Standalone: jax and numpy only. On one H200 (jax 0.11.2):

  python pallas-mha-x64.py

For float16, B=1, T=256, 4 heads, D=64 (T a multiple of mha's block of 128), with and
without segment ids and causal masking, runs the forward and its vjp with x64 off and on,
and prints whether each ran or the exception. Exits 1 if a call raised under x64 that ran
without it.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import attention


def call(x64, causal, segments, t=256):
  jax.config.update("jax_enable_x64", x64)
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, t, 4, 64)), jnp.float16) for _ in range(3))
  seg = jnp.asarray(rng.integers(0, 3, (1, t)), jnp.int32) if segments else None
  try:
    out, vjp = jax.vjp(lambda q, k, v: attention.mha(q, k, v, segment_ids=seg, causal=causal),
                       q, k, v)
    jax.block_until_ready(vjp(out))
    return "ran"
  except Exception as exc:  # noqa: BLE001
    return f"raised {type(exc).__name__}: {str(exc)[:300]}"


def main() -> int:
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}", flush=True)
  failed = False
  for causal in (False, True):
    for segments in (False, True):
      without, with_x64 = call(False, causal, segments), call(True, causal, segments)
      print(f"causal={causal} segment ids={segments}: without x64 {without}; "
            f"with x64 {with_x64}", flush=True)
      failed |= without == "ran" and with_x64 != "ran"
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
