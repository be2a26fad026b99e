"""Single-instruction forms of the kernels' transcendentals, and their CPU stand-ins.

Compiled for the GPU, :func:`exp2` is PTX ``ex2.approx.ftz.f32``, one
multi-function-unit operation. Pallas lowers ``jnp.exp2`` on float32 to
libdevice's ``__nv_exp2f``: the same instruction without ``.ftz``, for which
the assembler adds a range check and two conditional multiplies around it to
produce subnormal results. Softmax probabilities below 2^-126 are negligible
against a row sum of at least 1 (or, under a fixed shift, 2^-50; tile_math), so
flushing them to zero changes nothing the tolerances see. On an H200 it made
the no-cap forward 1.7% (full) and 3.1% (causal) faster, the tanh-capped one
4.2% and 2.0%, forward+backward 3.5% and 3.2%, with outputs bit-identical
(docs/BENCHMARKS.md, "What moved the forward"). On the CPU the
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
``approx_math`` (ua_kernels.mosaic_forward decides when it may be).

:func:`exp2_polynomial` computes 2^x on the fused multiply-add pipes instead
of the multi-function unit (MUFU): the integer part goes into the exponent
bits, the fraction through a cubic (relative error 1.0e-4, 2^-13.3). A
tanh-capped Mosaic forward issues two MUFU operations per logit (tanh, exp2),
which on the H200 keep the MUFU as busy as the tensor cores (docs/BENCHMARKS.md,
"Tanh cap, by pipe"), while the FMA pipes idle at about a fifth of their
throughput. Inside :func:`native` with ``fma_exp2``, :func:`exp2` of a score
tile therefore takes the MUFU for the first half of its columns and the
polynomial for the second: FlashAttention-4's split of the exponentials
between the two units.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton

_NATIVE = contextvars.ContextVar("ua_native_fast_math", default=None)
_FMA_EXP2 = contextvars.ContextVar("ua_fma_exp2", default=False)
_BACKENDS = (None, "triton", "mosaic")
_LOG2E = math.log2(math.e)


@contextlib.contextmanager
def native(backend, *, fma_exp2: bool = False):
  """Kernels traced inside use the GPU instructions of ``backend`` ("triton",
  "mosaic"), or the emulation (None: the Pallas interpreter); with
  ``fma_exp2`` (Mosaic only), exp2 of a score tile puts half of its columns on
  the FMA pipes (see the module doc)."""
  if backend not in _BACKENDS:
    raise ValueError(f"fast_math.native: backend must be one of {_BACKENDS}, got {backend!r}")
  if fma_exp2 and backend != "mosaic":
    raise ValueError(f"fast_math.native: fma_exp2 is for the Mosaic backend, not {backend!r}")
  tokens = _NATIVE.set(backend), _FMA_EXP2.set(fma_exp2)
  try:
    yield
  finally:
    _NATIVE.reset(tokens[0])
    _FMA_EXP2.reset(tokens[1])


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
  if _FMA_EXP2.get() and x.ndim == 2 and x.dtype == jnp.float32:
    half = x.shape[1] // 2
    return jnp.concatenate([jnp.exp2(x[:, :half]), exp2_polynomial(x[:, half:])], axis=1)
  return jnp.exp2(x)


# 1.5 * 2^23: adding it rounds a float32 of magnitude below 2^22 to an integer,
# which lands in the low bits of the sum's significand.
_ROUNDING_MAGIC = 12582912.0
_EXPONENT_150 = 0x4B000000
# 2^f = 1 + f * (c1 + f * (c2 + f * c3)) on [-1/2, 1/2], minimax in relative
# error with the constant term exactly 1 (so that 2^-127 comes out as +0.0).
_EXP2_CUBIC = (0.6932829022407532, 0.2422109693288803, 0.055009059607982635)


def exp2_polynomial(x):
  """2^x in float32 without a transcendental instruction, to 1.0e-4 relative,
  for x < 127 (softmax exponents are at most about 0); x <= -127, -inf
  included, gives +0.0, and results below 2^-126 are approximate subnormals
  (ex2.approx.ftz flushes those to zero: either is negligible beside a row sum
  of at least one). Nine operations on the FMA and integer pipes: clamp,
  round by the magic number, fraction, three multiply-adds, and the integer
  part shifted into the exponent bits."""
  x = jnp.maximum(x.astype(jnp.float32), -127.0)
  # The sum's low significand bits hold round(x) (to nearest even).
  rounded = lax.bitcast_convert_type(x + _ROUNDING_MAGIC, jnp.int32)
  # round(x) as a float. The OR is a no-op (every such sum has that exponent,
  # 150), but an opaque one: XLA (the CPU and the interpreters) would otherwise
  # fold (x + M) - M into x.
  whole = lax.bitcast_convert_type(rounded | _EXPONENT_150, jnp.float32) - _ROUNDING_MAGIC
  fraction = x - whole
  c1, c2, c3 = _EXP2_CUBIC
  mantissa = 1.0 + fraction * (c1 + fraction * (c2 + fraction * c3))
  # round(x) << 23 added to the exponent field: the magic number's own bits
  # shift out of the 32 (its low 9 bits are zero).
  exponent = lax.shift_left(rounded, jnp.int32(23))
  return lax.bitcast_convert_type(lax.bitcast_convert_type(mantissa, jnp.int32) + exponent,
                                  jnp.float32)


def approx_tanh(x):
  """tanh(x) in float32 to about 2^-11 relative (see the module doc)."""
  x = x.astype(jnp.float32)
  if _NATIVE.get() == "triton":
    return pltriton.approx_tanh(x)
  if _NATIVE.get() == "mosaic":
    return jnp.tanh(x)  # tanh.approx.f32: the kernel is built with approx_math
  return jnp.tanh(x).astype(jnp.float16).astype(jnp.float32)
