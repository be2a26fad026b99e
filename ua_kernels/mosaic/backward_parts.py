"""What the Mosaic backward's kernels share (ua_kernels.mosaic.backward says how
they work): their tiles' shapes and shared memory, their parameters, and the
warpgroup steps both the dq and the dk/dv kernels take."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from . import common
from .config import MosaicTiles
from ..tile_math import rescaled, scaled_back


MAX_HEAD_DIM = 256
# Above this head dim both kernels split the gradients' columns between their
# two compute warpgroups (dq_halves_kernel, dkv_halves_kernel), on a head dim
# padded to 2 * 128.
HALVES_ABOVE = 128
# The per-query rows' order in the rows array and ring (the forward's shift,
# SoftmaxState.finalize; delta; temperature).
SHIFT, DELTA, TEMP = 0, 1, 2


def unsupported(spec: StaticSpec, dtype, tiles: MosaicTiles | None = None) -> str | None:
  """Why the Mosaic backward cannot run this call (None: it can); with
  ``tiles``, also whether they fit the halves kernels' shared memory."""
  if why := common.dtype_error(dtype):
    return why
  if spec.head_dim > MAX_HEAD_DIM:
    return (f"the Mosaic backward takes head dims up to {MAX_HEAD_DIM}, not "
            f"{spec.head_dim}")
  if tiles is not None and spec.head_dim > HALVES_ABOVE:
    need = halves_shared_memory(tiles, jnp.dtype(dtype).itemsize)
    if need > common.MAX_SHARED_MEMORY:
      return (f"at head dims above {HALVES_ABOVE} the Mosaic backward with {tiles} needs "
              f"{need} bytes of shared memory, more than the "
              f"{common.MAX_SHARED_MEMORY} of a block")
  return None


def halves_shared_memory(tiles: MosaicTiles, itemsize: int) -> int:
  """Shared memory (bytes) of the larger of dq_halves_kernel and
  dkv_halves_kernel with ``tiles``: common.scratch_bytes of their
  scratch lists (dq_scratch, dkv_scratch) at head dim 2 * HALVES_ABOVE, with
  three per-query rows (temperature's too), for inputs of ``itemsize`` bytes.
  Tiles that pass MosaicTiles' validation can exceed a block's shared memory
  here (128-row tiles, three stages), which the dispatch sends to Triton.
  ``tiles`` filled (tuned_configs.effective_config)."""
  tiles.require_filled("backward.halves_shared_memory")
  dq, dkv = tile_shapes(tiles, jnp.dtype(f"float{8 * itemsize}"), 2 * HALVES_ABOVE,
                        num_rows=3, halves=True)
  return max(common.scratch_bytes(dq_scratch(dq)),
             common.scratch_bytes(dkv_scratch(dkv)))


@dataclasses.dataclass(frozen=True)
class TileShape:
  """The static shape of one backward kernel (dq or dk/dv), on which its
  scratch (dq_scratch, dkv_scratch) and grid depend."""
  dtype: Any
  head_dim: int         # padded; 2 * HALVES_ABOVE for the halves kernels
  block_q: int
  block_kv: int
  stages: int
  num_rows: int         # per-query rows: shift, delta (and temperature)
  halves: bool          # each compute warpgroup owns one half of the columns

  @property
  def half(self) -> int:
    return self.head_dim // 2


def tile_shapes(tiles: MosaicTiles, dtype, head_dim: int, *, num_rows: int,
                halves: bool) -> tuple[TileShape, TileShape]:
  """The dq and dk/dv kernels' TileShapes of a call. The dq halves kernel
  streams at most 64 keys per tile (two stages of 128 keys at head dim 256 do
  not fit beside the query halves)."""
  shape = functools.partial(TileShape, jnp.dtype(dtype), head_dim, stages=tiles.stages_bwd,
                            num_rows=num_rows, halves=halves)
  bkv_dq = min(tiles.block_kv_dq, 64) if halves else tiles.block_kv_dq
  return (shape(block_q=tiles.block_q_dq, block_kv=bkv_dq),
          shape(block_q=tiles.block_q_dkv, block_kv=tiles.block_kv_dkv))


@dataclasses.dataclass(frozen=True)
class BackwardParams:
  """The static parameters of one backward kernel: the contract's rules
  (``spec``; ``spec_padded`` is it over the padded length, which tile ranges
  count over), the options, and the kernel's TileShape."""
  spec: StaticSpec
  spec_padded: StaticSpec
  padded: bool          # the sequence is padded (visible_mask hides the padding)
  has_temp: bool
  fast_cap: bool
  shape: TileShape

  @property
  def group(self) -> int:
    return self.spec.group_size


def dq_scratch(shape: TileShape) -> list:
  """The shared memory of dq_kernel, or with ``shape.halves`` dq_halves_kernel:
  Q and dO (two tiles, or two column halves of one tile), the K and V rings;
  then the barriers: Q and dO loaded (one per tile, or one per half of each),
  K and V loaded per slot, the slot's release; the halves kernel's
  "gradients computed" barrier."""
  plgpu = common.plgpu()
  swizzled = common.swizzled()
  own = (2, shape.block_q, shape.half if shape.halves else shape.head_dim)
  ring = (shape.stages, shape.block_kv, shape.head_dim)
  smem = [plgpu.SMEM(own, shape.dtype, transforms=swizzled),
          plgpu.SMEM(own, shape.dtype, transforms=swizzled),
          plgpu.SMEM(ring, shape.dtype, transforms=swizzled),
          plgpu.SMEM(ring, shape.dtype, transforms=swizzled)]
  ring_barriers = [plgpu.Barrier(num_barriers=shape.stages),
                   plgpu.Barrier(num_barriers=shape.stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=shape.stages)]
  if shape.halves:
    return [*smem, plgpu.Barrier(num_barriers=4), *ring_barriers,
            plgpu.Barrier(num_arrivals=2)]
  return [*smem, plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
          *ring_barriers]


def dkv_scratch(shape: TileShape) -> list:
  """The shared memory of dkv_kernel, or with ``shape.halves``
  dkv_halves_kernel: K and V (two tiles, or two column halves of one tile),
  the Q, dO and per-query rows rings; then the barriers: K and V loaded (one
  per tile, or one per half of each), Q, dO and rows loaded per slot, the
  slot's release; the halves kernel's "gradients computed" barrier."""
  plgpu = common.plgpu()
  swizzled = common.swizzled()
  own = (2, shape.block_kv, shape.half if shape.halves else shape.head_dim)
  ring = (shape.stages, shape.block_q, shape.head_dim)
  smem = [plgpu.SMEM(own, shape.dtype, transforms=swizzled),
          plgpu.SMEM(own, shape.dtype, transforms=swizzled),
          plgpu.SMEM(ring, shape.dtype, transforms=swizzled),
          plgpu.SMEM(ring, shape.dtype, transforms=swizzled),
          plgpu.SMEM((shape.stages, shape.num_rows, shape.block_q), jnp.float32)]
  ring_barriers = [plgpu.Barrier(num_barriers=shape.stages),
                   plgpu.Barrier(num_barriers=shape.stages),
                   plgpu.Barrier(num_barriers=shape.stages),
                   plgpu.Barrier(num_arrivals=2, num_barriers=shape.stages)]
  if shape.halves:
    return [*smem, plgpu.Barrier(num_barriers=4), *ring_barriers,
            plgpu.Barrier(num_arrivals=2)]
  return [*smem, plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2),
          *ring_barriers]


def fused_scratch(shape: TileShape) -> list:
  """The shared memory of the fused kernel (dkv.dkv_dq_kernel): dkv_kernel's,
  then per compute warpgroup a ds tile [block_kv, block_q] in the inputs'
  dtype, as wgmma reads it, and a float32 dq share [block_q, head_dim], as
  wgmma's result is stored and TMA reads it (128-byte swizzled rows)."""
  plgpu = common.plgpu()
  f32_swizzled = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  return [*dkv_scratch(shape),
          plgpu.SMEM((2, shape.block_kv, shape.block_q), shape.dtype,
                     transforms=common.swizzled()),
          plgpu.SMEM((2, shape.block_q, shape.head_dim), jnp.float32, transforms=f32_swizzled)]


def fused_unsupported(spec: StaticSpec, dtype, tiles: MosaicTiles) -> str | None:
  """Why the fused backward (deterministic=False, or MosaicTiles.ordered_fused)
  cannot run this call, where
  the Mosaic backward can (None: it can). ``tiles`` filled. float16 would
  scale each query's ds into its range (matmul_operand) for dq, dk's scale
  being per key: a max down the columns of the keys-by-queries tile, across
  warps, which Mosaic reduces through one shared-memory area that both compute
  warpgroups would use at once. The shared memory counted here is the scratch
  list's; Mosaic's lowering (tests/test_mosaic.py lowers the tuned tiles) also
  places its own scratch and alignment."""
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return (f"the fused backward takes bfloat16, not {jnp.dtype(dtype).name} (float16's "
            f"per-query range scaling of ds for dq is not race-free there)")
  if spec.head_dim > HALVES_ABOVE:
    return f"the fused backward takes head dims up to {HALVES_ABOVE}, not {spec.head_dim}"
  _, shape = tile_shapes(tiles, dtype, common.padded_head_dim(spec.head_dim), num_rows=3,
                         halves=False)
  need = common.scratch_bytes(fused_scratch(shape))
  if need > common.MAX_SHARED_MEMORY:
    return (f"the fused backward with {tiles} needs {need} bytes of shared memory, more than "
            f"the {common.MAX_SHARED_MEMORY} of a block")
  return None


# --- helpers of the four kernels ------------------------------------------------------

def _column_half(part: int, half: int):
  return pl.ds(part * half, half)


def _ring_columns(ring, s, part, half: int):
  """Slot ``s`` of ``ring``, whole (``part`` None) or its column half ``part``."""
  return ring.at[s] if part is None else ring.at[s, :, _column_half(part, half)]


class _Scaled(NamedTuple):
  """A float16 gradient's float32 accumulator and its rows' exponents: the
  gradient is ``acc`` times 2^-exponent, row by row (matmul_operand's)."""
  acc: Any
  exponent: Any


def _zero_gradient(rows: int, columns: int, scaled: bool = False):
  """A gradient accumulator of zeros in wgmma's layout; ``scaled`` (dq and dk
  where range_scaled) a _Scaled one, whose rows follow the range scaling of
  the ds they sum."""
  plgpu = common.plgpu()
  zeros = plgpu.layout_cast(jnp.zeros((rows, columns), jnp.float32), plgpu.Layout.WGMMA)
  if not scaled:
    return zeros
  return _Scaled(zeros, plgpu.layout_cast(jnp.zeros((rows,), jnp.int32),
                                          plgpu.Layout.WGMMA.reduce(1)))


def _gradient(acc):
  """The float32 gradient of an accumulator of _zero_gradient's kind."""
  return scaled_back(acc.acc, acc.exponent) if isinstance(acc, _Scaled) else acc


def _accumulate(acc, a, b_smem, exponent):
  """acc + a @ b by wgmma, accumulated in place. With matmul_operand's
  ``exponent`` (float16) the _Scaled accumulator's rows are first brought to
  the operand's scale (tile_math.rescaled: two multiplies per element), and no
  second accumulator takes the product from zero (docs/HISTORY.md, "The
  float16 range scaling in place"). A row's sum that leaves float32's range
  when brought up (beyond 2^65, for a tile of |ds| below 2^-48) is beyond
  float16's output range too."""
  plgpu = common.plgpu()
  product = lambda acc_ref: plgpu.wgmma(acc_ref, a, b_smem)
  if exponent is None:
    return pl.run_state(product)(plgpu.ACC.init(acc))
  rescaled_acc = rescaled(acc.acc, acc.exponent, exponent)
  return _Scaled(pl.run_state(product)(plgpu.ACC.init(rescaled_acc)), exponent)


def _scores_pair(a_parts, b_ring, c_parts, d_ring, s, shape, half: int):
  """(A B^T, C D^T) in float32, A and C the program's own tiles, B and D slot
  ``s`` of the streamed rings, all wgmmas issued before either is waited for.
  ``a_parts`` and ``c_parts`` are (operand, column half or None): one whole
  tile, or the two column halves of the halves kernels, each against the
  same columns of the ring's slot."""
  plgpu = common.plgpu()
  b_parts = [_ring_columns(b_ring, s, part, half).transpose((1, 0)) for _, part in a_parts]
  d_parts = [_ring_columns(d_ring, s, part, half).transpose((1, 0)) for _, part in c_parts]

  def both(acc1, acc2):
    for (a, _), b, (c, _), d in zip(a_parts, b_parts, c_parts, d_parts):
      plgpu.wgmma(acc1, a, b)
      plgpu.wgmma(acc2, c, d)
    return acc1[...], acc2[...]

  return pl.run_scoped(both, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))


def _own_parts(own_smem, part):
  """The own tile's scores operands: the whole tile (``part`` None: own_smem
  is the warpgroup's tile) or both column halves (own_smem holds them)."""
  if part is None:
    return ((own_smem, None),)
  return tuple((own_smem.at[c], c) for c in range(2))


def _query_rows(p: BackwardParams, load):
  """(shift, delta, temperature or None) of a tile's queries; ``load(i)`` reads
  per-query row i."""
  shift_q, delta_q = load(SHIFT), load(DELTA)
  return shift_q, delta_q, load(TEMP) if p.has_temp else None


def _load_halves(refs, halves, own, loaded, half: int):
  """The program's own tiles of ``refs`` into their [2, rows, half]
  buffers, buffer i's half c arriving at barrier 2 * i + c."""
  plgpu = common.plgpu()
  for c in range(2):
    for i, (ref, buffer) in enumerate(zip(refs, halves)):
      plgpu.copy_gmem_to_smem(ref.at[own + (_column_half(c, half),)], buffer.at[c],
                              loaded.at[2 * i + c])


def _store_halves(p: BackwardParams, part: int, computed, outputs, own):
  """Warpgroup ``part``'s half of each gradient in ``outputs`` (the own
  tiles' halves buffer, which holds it on its way out; the output ref; the
  value) written out, once both warpgroups are done reading the own tiles."""
  plgpu = common.plgpu()
  plgpu.barrier_arrive(computed)
  plgpu.barrier_wait(computed)
  for halves, _, value in outputs:
    halves[part] = value.astype(p.shape.dtype)
  plgpu.commit_smem()
  for halves, ref, _ in outputs:
    plgpu.copy_smem_to_gmem(halves.at[part], ref.at[own + (_column_half(part, p.shape.half),)])
  plgpu.wait_smem_to_gmem(0)


def _run_halves(wg, compute, memory):
  """Warpgroups 0 and 1 run ``compute(part)`` for their half, 2 ``memory()``."""
  plgpu = common.plgpu()
  for part in (0, 1):
    @pl.when(wg == part)
    def _(part=part):
      plgpu.set_max_registers(232, action="increase")
      compute(part)

  pl.when(wg == 2)(memory)


# --- dq ---------------------------------------------------------------------------------

