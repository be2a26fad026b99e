"""What the Mosaic GPU forward and backward kernels share: the module import,
version differences of its API, and the padded layout."""

from __future__ import annotations

import inspect
import math

import jax.numpy as jnp

from ua_reference.contract import StaticSpec

# bfloat16 and float16: wgmma's 16-bit operands (float32 stays on Triton).
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Head dims are padded to a multiple of 64: one 128-byte swizzled row of
# 16-bit values.
HEAD_DIM_MULTIPLE = 64


def plgpu():
  """jax.experimental.pallas.mosaic_gpu, imported when first used: Mosaic GPU's
  Python modules load MLIR bindings (and, under jax 0.10, absl), which nothing
  else of the package needs."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


def load_vector(ref, layout):
  """plgpu.load of a whole 1-D ref: jax 0.10 requires the index argument,
  0.11 deprecates it."""
  mgpu = plgpu()
  if inspect.signature(mgpu.load).parameters["idx"].default is inspect.Parameter.empty:
    return mgpu.load(ref, (), layout=layout, optimized=False)
  return mgpu.load(ref, layout=layout, optimized=False)


def position_tiles(shape, q_start, k_start, query_axis: int):
  """(query positions, key positions) of a score tile in wgmma's layout, for
  tile_math.visible_mask; the tile holds queries along ``query_axis``."""
  mgpu = plgpu()
  iota = lambda axis: mgpu.broadcasted_iota(jnp.int32, shape, axis, layout=mgpu.Layout.WGMMA)
  return q_start + iota(query_axis), k_start + iota(1 - query_axis)


def swizzled():
  """The transforms of a 16-bit [rows, head_dim] tile in shared memory, as
  TMA writes it and wgmma reads it."""
  mgpu = plgpu()
  return (mgpu.TilingTransform((8, 64)), mgpu.SwizzleTransform(128))


def approx_math(spec: StaticSpec, fast_cap: bool) -> bool:
  """Whether a kernel is built with approx_math, which makes every exp2,
  log and tanh of the kernel an ``.approx`` instruction: without a cap (the
  softmax's exp2 is the Triton kernels' ex2.approx too) or with the caps'
  fast forms (bfloat16). Exact caps (float16; caps above FAST_CAP_MAX_PARAM)
  keep accurate transcendentals."""
  return spec.cap_method == "none" or fast_cap


def padded_head_dim(head_dim: int) -> int:
  return -(-head_dim // HEAD_DIM_MULTIPLE) * HEAD_DIM_MULTIPLE


def padded_length(seq_len: int, *tile_rows: int) -> int:
  """The sequence length padded to a multiple of every program's rows."""
  step = math.lcm(*tile_rows)
  return -(-seq_len // step) * step


def dtype_error(dtype) -> str | None:
  if jnp.dtype(dtype) not in DTYPES:
    return f"the Mosaic backend takes bfloat16 and float16, not {jnp.dtype(dtype).name}"
  return None
