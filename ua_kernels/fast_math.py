"""Single-instruction approximations for the bfloat16 kernels, and their emulation.

Compiled for the GPU, :func:`approx_tanh` is PTX ``tanh.approx.f32``: one
multi-function-unit operation instead of the two (exp2 and a reciprocal) plus
a polynomial of an accurate tanh, with a relative error of about 2^-11. The
Pallas interpreter (CPU) cannot run inline PTX, so there the same function
rounds the exact tanh to float16's 11 significant bits: an error of the same
size, so that the CPU suite measures its effect against the tolerances, and
the GPU suite checks the instruction itself.

Which one a kernel traces is set by :func:`native`, which ua_kernels.attention
enters around each compiled (non-interpreted) pallas_call.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

_NATIVE = contextvars.ContextVar("ua_native_fast_math", default=False)


@contextlib.contextmanager
def native(enabled: bool):
  """Kernels traced inside use the GPU instructions (``enabled``) or the emulation."""
  token = _NATIVE.set(enabled)
  try:
    yield
  finally:
    _NATIVE.reset(token)


def approx_tanh(x):
  """tanh(x) in float32 to about 2^-11 relative (see the module doc)."""
  x = x.astype(jnp.float32)
  if _NATIVE.get():
    return pltriton.approx_tanh(x)
  return jnp.tanh(x).astype(jnp.float16).astype(jnp.float32)
