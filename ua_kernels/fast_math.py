"""Single-instruction forms of the kernels' transcendentals, and their CPU stand-ins.

Compiled for the GPU, :func:`exp2` is PTX ``ex2.approx.ftz.f32``, one
multi-function-unit operation. Pallas lowers ``jnp.exp2`` on float32 to
libdevice's ``__nv_exp2f``: the same instruction without ``.ftz``, for which
the assembler adds a range check and two conditional multiplies around it to
produce subnormal results. Softmax probabilities below 2^-126 are negligible
against a row sum of at least 1 (or, under a fixed shift, 2^-50; tile_math), so
flushing them to zero changes nothing the tolerances see; it made the forward
and backward faster with outputs bit-identical (docs/HISTORY.md, "What
moved the forward, measured"). On the CPU the
function is ``jnp.exp2``; XLA:CPU flushes subnormals too, so both give 0 below
2^-126.

:func:`approx_tanh` (bfloat16 kernels only) is PTX ``tanh.approx.f32``: one
multi-function-unit operation instead of the two (exp2 and a reciprocal) plus
a polynomial of an accurate tanh, with a relative error of about 2^-11. The
Pallas interpreter (CPU) cannot run inline PTX, so there the same function
rounds the exact tanh to float16's 11 significant bits: an error of the same
size, so that the CPU suite measures its effect against the tolerances, and
the GPU suite checks the instruction itself.

Which one a kernel traces is set by :func:`native`, which ua_kernels.attention
enters around each compiled (non-interpreted) pallas_call, naming the backend:
Pallas-Triton takes the inline PTX above; Pallas Mosaic GPU has no inline
elementwise assembly, and instead compiles ``jnp.exp2``/``jnp.tanh``/``jnp.log``
to the same ``.approx`` instructions when the kernel is built with
``approx_math`` (cap_forms.approx_math decides when it may be).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

_NATIVE = contextvars.ContextVar("ua_native_fast_math", default=None)
_BACKENDS = (None, "triton", "mosaic")
_LOG2E = math.log2(math.e)


@contextlib.contextmanager
def native(backend):
  """Kernels traced inside use the GPU instructions of ``backend`` ("triton",
  "mosaic"), or the emulation (None: the Pallas interpreter)."""
  if backend not in _BACKENDS:
    raise ValueError(f"fast_math.native: backend must be one of {_BACKENDS}, got {backend!r}")
  token = _NATIVE.set(backend)
  try:
    yield
  finally:
    _NATIVE.reset(token)


def native_backend():
  """The backend whose instructions kernels traced now use (None: the
  Pallas interpreter's emulation)."""
  return _NATIVE.get()


def log2(x):
  """log2 in float32. Mosaic GPU under jax 0.10 has no lowering for log2, so
  there it is log(x) * log2(e), one rounding more (2^-24 relative)."""
  if _NATIVE.get() == "mosaic":
    return jnp.log(x) * _LOG2E
  return jnp.log2(x)


def exp2(x):
  """2^x in float32 (see the module doc); other dtypes take ``jnp.exp2``."""
  if _NATIVE.get() == "triton" and x.dtype == jnp.float32:
    [result] = pltriton.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct.like(x)])
    return result
  return jnp.exp2(x)


def approx_tanh(x):
  """tanh(x) in float32 to about 2^-11 relative (see the module doc)."""
  x = x.astype(jnp.float32)
  if _NATIVE.get() == "triton":
    return pltriton.approx_tanh(x)
  if _NATIVE.get() == "mosaic":
    return jnp.tanh(x)  # tanh.approx.f32: the kernel is built with approx_math
  return jnp.tanh(x).astype(jnp.float16).astype(jnp.float32)


def tanh_complement(y, t):
  """1 - tanh(y)^2 given t = approx_tanh(y), as e (1 + |t|)^2 with e =
  exp(-2|y|): equal to 4e / (1 + e)^2, since 1 + |tanh y| = 2 / (1 + e). The
  fast t's 2^-11 moves 1 + |t| by at most 2^-12 relative, where 1 - t^2 of the
  same t cancels: above |y| = 4, t is within 2^-11 of 1 and the derivative
  below 1.3e-3 (docs/DEFECTS.md, B34). One exp2 more than 1 - t^2, in the
  backward only, and no division."""
  e = exp2(jnp.abs(y.astype(jnp.float32)) * (-2.0 * _LOG2E))
  s = 1.0 + jnp.abs(t)
  return e * (s * s)
