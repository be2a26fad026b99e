"""The backward kernels on Pallas Mosaic GPU, for Hopper (sm90): dq, and dk/dv
summed over a GQA group.

``backward`` pads the inputs and calls two of the four kernels, each with a
BackwardParams (its static parameters, holding its TileShape) and the scratch
of ``dq_scratch``/``dkv_scratch`` for that shape: ``dq_kernel`` and
``dkv_kernel``, or above head dim 128 ``dq_halves_kernel`` and
``dkv_halves_kernel``. ``halves_shared_memory`` and ``unsupported`` count the
halves kernels' shared memory from the same scratch lists
(common.scratch_bytes).

All four have the forward's structure (ua_kernels.mosaic.forward): a program
has two compute warpgroups and a third that only issues TMA copies of the
streamed tiles into a ring of ``stages`` shared-memory slots
(common.producer_ring). A slot has a "loaded" barrier per buffer (TMA
arrives) and one "free" barrier that both compute warpgroups arrive at when
done with it. In dq_kernel and dkv_kernel each compute warpgroup owns one tile
and passes over the streamed tiles outside its own range ("drain"), as in the
forward, since a barrier's phase is tracked by each waiting thread.

dq: a program owns query rows of one query head and streams the key and
value tiles of their range: s = Q K^T and dp = dO V^T by wgmma, then
dq += ds K (``_dq_step``).

dk/dv: a program owns keys of one kv head and streams, for every query tile
of their range and every query head of the group (the group sum happens in
registers; no repeated K/V), the tiles of Q and dO and the per-query rows
(lse, delta, temperature) in one TMA copy. wgmma's A operand comes from
shared memory or registers and its B from shared memory, so the kernel scores
keys against queries, sT = K Q^T, and takes pT and dsT from registers for
dv += pT dO and dk += dsT Q (``_dkv_step``): its tiles hold queries along
axis 1 (tile_math's ``query_axis``).

Every rule of the contract comes from tile_math, shared with the Triton
kernels: scores_to_logits and visible_mask (through common.tile_logits,
as in the forward), probabilities, logits_grad (the cap's
derivative from the registry), matmul_operand (float16's range), and the tile
ranges q_tiles/kv_tiles (with segment ids, within the spans of the tile's
documents, and inside its run of one id masked by position only, or not at
all inside the band too).

Head dims above 128 (up to 256, padded to 256): one warpgroup's dk and dv of
64 keys (or dq of 64 rows) would need 256 registers per thread, so
dq_halves_kernel and dkv_halves_kernel give a program one tile and each compute
warpgroup one half of the gradients' columns; both warpgroups compute the
scores and dp of the tile over the whole head dim. They share the steps
(``_dq_step``, ``_dkv_step``, whose ``part`` picks the column half) and the
memory warpgroups with the others; a program of one tile needs no drain.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from .. import fast_math
from . import common
from .config import MosaicTiles
from .common import (RingCopy, launched_q_tile, load_vector, own_tiles, position_tiles,
                            program_spans, program_tiles, ring_slot, tile_logits, tile_span)
from ..padding import pad
from ..segment_spans import tile_ranges
from ..tile_math import (dither_bits, kv_tiles, logits_grad, matmul_operand, probabilities,
                        q_tiles, range_scaled, rescaled, scaled_back, tile_loop, to_operand,
                        unbiased_roundings)

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

class _KeyRing(NamedTuple):
  """The dq kernels' ring of streamed K and V tiles, over key tiles [lo, hi)."""
  lo: Any
  hi: Any
  k_smem: Any
  v_smem: Any
  k_loaded: Any
  v_loaded: Any
  kv_free: Any


def _stream_keys(p: BackwardParams, ring: _KeyRing, k_ref, v_ref, bi, kv_head):
  """The dq kernels' memory warpgroup: key tiles [lo, hi) into the ring."""
  bkv = p.shape.block_kv

  def locate(kb):
    return (bi, pl.ds(kb * bkv, bkv), kv_head)

  common.producer_ring(ring.lo, ring.hi, p.shape.stages, locate, [
      (ring.kv_free, [RingCopy(lambda keys: k_ref.at[keys], ring.k_smem, ring.k_loaded),
                      RingCopy(lambda keys: v_ref.at[keys], ring.v_smem, ring.v_loaded)])])


def _dq_step(p: BackwardParams, ring: _KeyRing, q_own, do_own, part, seg_ref, bi, q_start,
             rows, kb, dq, masked):
  """One key tile of a dq warpgroup: s = Q K^T and dp = dO V^T, then
  dq += ds K, over the whole head dim (``part`` None) or dq's column half
  ``part`` (``q_own``/``do_own`` then hold both halves)."""
  plgpu = common.plgpu()
  shape = p.shape
  shift_q, delta_q, temp_q = rows
  s = ring_slot(kb, ring.lo, shape.stages)
  plgpu.barrier_wait(ring.k_loaded.at[s])
  plgpu.barrier_wait(ring.v_loaded.at[s])
  scores, dp = _scores_pair(_own_parts(q_own, part), ring.k_smem, _own_parts(do_own, part),
                            ring.v_smem, s, (shape.block_q, shape.block_kv), shape.half)
  logits = tile_logits(p.spec, scores, temp_q, q_start, kb * shape.block_kv, masked=masked,
                       seg_ref=seg_ref, batch=bi, padded=p.padded, fast_cap=p.fast_cap)
  probs = probabilities(logits, shift_q)
  ds = logits_grad(p.spec, probs, dp, delta_q, logits, temp_q, p.fast_cap)
  bits = (dither_bits(*position_tiles(ds.shape, q_start, kb * shape.block_kv, 0), 1)
          if unbiased_roundings(p.spec, shape.dtype)[1] else None)
  ds16, exponent = matmul_operand(ds, shape.dtype, axis=1, bits=bits)
  dq = _accumulate(dq, ds16, _ring_columns(ring.k_smem, s, part, shape.half), exponent)
  plgpu.barrier_arrive(ring.kv_free.at[s])
  return dq


def dq_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref,
              dq_ref, q_smem2, do_smem2, k_smem, v_smem,
              q_loaded, do_loaded, k_loaded, v_loaded, kv_free):
  """dq: a program owns 2 * block_q query rows of one query head, each compute
  warpgroup one tile of block_q; the memory warpgroup streams the key and
  value tiles of the hull of their ranges."""
  plgpu = common.plgpu()
  bq, bkv = p.shape.block_q, p.shape.block_kv
  bi = lax.axis_index("batch")
  h = lax.axis_index("heads")
  tile = launched_q_tile(p.spec, p.spec_padded.seq_len // (2 * bq))
  wg = lax.axis_index("wg")
  kv_head = lax.div(h, jnp.int32(p.group))
  hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
  cta_lo, cta_hi = program_tiles(kv_tiles(
      p.spec_padded, tile * 2 * bq, 2 * bq, bkv, p.padded, hull))
  ring = _KeyRing(cta_lo, cta_hi, k_smem, v_smem, k_loaded, v_loaded, kv_free)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    q_smem, do_smem = q_smem2.at[wg], do_smem2.at[wg]
    q_start = tile * 2 * bq + wg * bq
    own = (bi, pl.ds(q_start, bq), h)
    plgpu.copy_gmem_to_smem(q_ref.at[own], q_smem, q_loaded.at[wg])
    plgpu.copy_gmem_to_smem(do_ref.at[own], do_smem, do_loaded.at[wg])
    rows = _query_rows(p, lambda i: load_vector(rows_ref.at[bi, h, i, pl.ds(q_start, bq)],
                                                plgpu.Layout.WGMMA.reduce(1)))
    plgpu.barrier_wait(q_loaded.at[wg])
    plgpu.barrier_wait(do_loaded.at[wg])

    def drain(kb, dq):
      s = ring_slot(kb, cta_lo, p.shape.stages)
      plgpu.barrier_wait(k_loaded.at[s])
      plgpu.barrier_wait(v_loaded.at[s])
      plgpu.barrier_arrive(kv_free.at[s])
      return dq

    def visit(kb, dq, masked):
      return _dq_step(p, ring, q_smem, do_smem, None, seg_ref, bi, q_start, rows, kb, dq,
                      masked)

    dq = _zero_gradient(bq, p.shape.head_dim, range_scaled(p.shape.dtype))
    tiles = own_tiles(kv_tiles(
        p.spec_padded, q_start, bq, bkv, p.padded,
        own_span, own_uniform), cta_lo, cta_hi)
    dq = lax.fori_loop(cta_lo, tiles.lo, drain, dq)
    dq = tile_loop(tiles, visit, dq)
    dq = lax.fori_loop(tiles.hi, cta_hi, drain, dq)
    q_smem[...] = _gradient(dq).astype(p.shape.dtype)  # Q's buffer holds dq on its way out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, dq_ref.at[own])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    _stream_keys(p, ring, k_ref, v_ref, bi, kv_head)


def dq_halves_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref,
                     spans_ref, dq_ref, q_halves, do_halves, k_smem, v_smem,
                     qdo_loaded, k_loaded, v_loaded, kv_free, computed):
  """dq at head dims above 128: a program owns block_q query rows, and each
  compute warpgroup accumulates one half of dq's columns (dkv_halves_kernel's
  split); both compute the scores and dp over the whole head dim. Key tiles
  of at most 64 keys (tile_shapes), so that the K/V ring fits the shared
  memory."""
  plgpu = common.plgpu()
  bq, bkv = p.shape.block_q, p.shape.block_kv
  bi = lax.axis_index("batch")
  h = lax.axis_index("heads")
  tile = launched_q_tile(p.spec, p.spec_padded.seq_len // bq)
  wg = lax.axis_index("wg")
  kv_head = lax.div(h, jnp.int32(p.group))
  q_start = tile * bq
  tiles = kv_tiles(p.spec_padded, q_start, bq, bkv, p.padded,
                   *tile_span(spans_ref, bi, tile))
  lo, hi = program_tiles(tiles)
  tiles = own_tiles(tiles, lo, hi)
  ring = _KeyRing(lo, hi, k_smem, v_smem, k_loaded, v_loaded, kv_free)
  own = (bi, pl.ds(q_start, bq), h)

  def compute(part):
    if part == 0:  # one warpgroup loads the shared Q and dO halves
      _load_halves((q_ref, do_ref), (q_halves, do_halves), own, qdo_loaded, p.shape.half)
    rows = _query_rows(p, lambda i: load_vector(rows_ref.at[bi, h, i, pl.ds(q_start, bq)],
                                                plgpu.Layout.WGMMA.reduce(1)))
    for i in range(4):
      plgpu.barrier_wait(qdo_loaded.at[i])

    def visit(kb, dq, masked):
      return _dq_step(p, ring, q_halves, do_halves, part, seg_ref, bi, q_start, rows, kb, dq,
                      masked)

    dq = tile_loop(tiles, visit, _zero_gradient(bq, p.shape.half, range_scaled(p.shape.dtype)))
    _store_halves(p, part, computed, [(q_halves, dq_ref, _gradient(dq))], own)

  _run_halves(wg, compute, lambda: _stream_keys(p, ring, k_ref, v_ref, bi, kv_head))


# --- dk/dv ------------------------------------------------------------------------------

class _QueryRing(NamedTuple):
  """The dk/dv kernels' ring of streamed Q, dO and per-query rows tiles, over
  steps [first, last): step n is query tile n // group of query head
  kv_head * group + n % group."""
  first: Any
  last: Any
  q_smem: Any
  do_smem: Any
  rows_smem: Any
  q_loaded: Any
  do_loaded: Any
  rows_loaded: Any
  q_free: Any


def _stream_queries(p: BackwardParams, ring: _QueryRing, q_ref, do_ref, rows_ref, bi,
                    kv_head):
  """The dk/dv kernels' memory warpgroup: steps [first, last) into the ring."""
  bq, group = p.shape.block_q, p.group

  def locate(n):
    qb = lax.div(n, jnp.int32(group))
    h = kv_head * group + lax.rem(n, jnp.int32(group))
    return qb, h, (bi, pl.ds(qb * bq, bq), h)

  common.producer_ring(ring.first, ring.last, p.shape.stages, locate, [
      (ring.q_free, [
          RingCopy(lambda where: q_ref.at[where[2]], ring.q_smem, ring.q_loaded),
          RingCopy(lambda where: do_ref.at[where[2]], ring.do_smem, ring.do_loaded),
          RingCopy(lambda where: rows_ref.at[bi, where[1], :, pl.ds(where[0] * bq, bq)],
                   ring.rows_smem, ring.rows_loaded)])])


def _dkv_step(p: BackwardParams, ring: _QueryRing, k_own, v_own, part, seg_ref, bi, k_start,
              qb, g, carry, masked):
  """One step of a dk/dv warpgroup (query tile ``qb`` of the group's query
  head ``g``): sT = K Q^T and dpT = V dO^T, then dv += pT dO and dk += dsT Q,
  over the whole head dim (``part`` None) or the gradients' column half
  ``part`` (``k_own``/``v_own`` then hold both halves)."""
  plgpu = common.plgpu()
  shape = p.shape
  dk, dv = carry
  s = ring_slot(qb * p.group + g, ring.first, shape.stages)
  q_start = qb * shape.block_q
  plgpu.barrier_wait(ring.q_loaded.at[s])
  plgpu.barrier_wait(ring.do_loaded.at[s])
  scores_t, dp_t = _scores_pair(_own_parts(k_own, part), ring.q_smem, _own_parts(v_own, part),
                                ring.do_smem, s, (shape.block_kv, shape.block_q), shape.half)
  plgpu.barrier_wait(ring.rows_loaded.at[s])
  shift_q, delta_q, temp_q = _query_rows(
      p, lambda i: load_vector(ring.rows_smem.at[s, i], plgpu.Layout.WGMMA.reduce(0)))
  logits = tile_logits(p.spec, scores_t, temp_q, q_start, k_start, masked=masked,
                       seg_ref=seg_ref, batch=bi, padded=p.padded, fast_cap=p.fast_cap,
                       query_axis=1)
  p_t = probabilities(logits, shift_q)
  unbiased_p, unbiased_ds = unbiased_roundings(p.spec, shape.dtype)
  grid = (position_tiles(p_t.shape, q_start, k_start, 1) if unbiased_p or unbiased_ds
          else None)
  dv = _accumulate(dv, to_operand(p_t, shape.dtype,
                                  dither_bits(*grid, 0) if unbiased_p else None),
                   _ring_columns(ring.do_smem, s, part, shape.half), None)
  ds_t = logits_grad(p.spec, p_t, dp_t, delta_q, logits, temp_q, p.fast_cap)
  ds16, exponent = matmul_operand(ds_t, shape.dtype, axis=1,
                                  bits=dither_bits(*grid, 1) if unbiased_ds else None)
  dk = _accumulate(dk, ds16, _ring_columns(ring.q_smem, s, part, shape.half), exponent)
  plgpu.barrier_arrive(ring.q_free.at[s])
  return dk, dv


def _group_steps(p: BackwardParams, step):
  """tile_loop's visit of a query tile: ``step(qb, g, carry, masked)`` for
  every query head g of the group."""
  def query_tile(qb, carry, masked):
    return lax.fori_loop(0, p.group, lambda g, c: step(qb, g, c, masked), carry)
  return query_tile


def dkv_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref,
               dk_ref, dv_ref, k_smem2, v_smem2, q_smem, do_smem, rows_smem,
               k_loaded, v_loaded, q_loaded, do_loaded, rows_loaded, q_free):
  """dk/dv: a program owns 2 * block_kv keys of one kv head, each compute
  warpgroup one tile of block_kv; the memory warpgroup streams the query
  tiles of the hull of their ranges, for every query head of the group."""
  plgpu = common.plgpu()
  bq, bkv, group = p.shape.block_q, p.shape.block_kv, p.group
  bi = lax.axis_index("batch")
  kv_head = lax.axis_index("heads")
  tile = lax.axis_index("kv_tiles")
  wg = lax.axis_index("wg")
  hull, own_span, own_uniform = program_spans(spans_ref, bi, tile, wg)
  cta_lo, cta_hi = program_tiles(q_tiles(
      p.spec_padded, tile * 2 * bkv, bq, 2 * bkv, p.padded, hull))
  first, last = cta_lo * group, cta_hi * group
  ring = _QueryRing(first, last, q_smem, do_smem, rows_smem, q_loaded, do_loaded,
                    rows_loaded, q_free)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    k_smem, v_smem = k_smem2.at[wg], v_smem2.at[wg]
    k_start = tile * 2 * bkv + wg * bkv
    own = (bi, pl.ds(k_start, bkv), kv_head)
    plgpu.copy_gmem_to_smem(k_ref.at[own], k_smem, k_loaded.at[wg])
    plgpu.copy_gmem_to_smem(v_ref.at[own], v_smem, v_loaded.at[wg])
    plgpu.barrier_wait(k_loaded.at[wg])
    plgpu.barrier_wait(v_loaded.at[wg])

    def drain(n, carry):
      s = ring_slot(n, first, p.shape.stages)
      plgpu.barrier_wait(q_loaded.at[s])
      plgpu.barrier_wait(do_loaded.at[s])
      plgpu.barrier_wait(rows_loaded.at[s])
      plgpu.barrier_arrive(q_free.at[s])
      return carry

    def step(qb, g, carry, masked):
      return _dkv_step(p, ring, k_smem, v_smem, None, seg_ref, bi, k_start, qb, g, carry,
                       masked)

    zeros = (_zero_gradient(bkv, p.shape.head_dim, range_scaled(p.shape.dtype)),
             _zero_gradient(bkv, p.shape.head_dim))
    tiles = own_tiles(q_tiles(
        p.spec_padded, k_start, bq, bkv, p.padded,
        own_span, own_uniform), cta_lo, cta_hi)
    carry = lax.fori_loop(first, tiles.lo * group, drain, zeros)
    carry = tile_loop(tiles, _group_steps(p, step), carry)
    dk, dv = lax.fori_loop(tiles.hi * group, last, drain, carry)
    # K's and V's buffers hold dk, dv on their way out.
    k_smem[...] = _gradient(dk).astype(p.shape.dtype)
    v_smem[...] = dv.astype(p.shape.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(k_smem, dk_ref.at[own])
    plgpu.copy_smem_to_gmem(v_smem, dv_ref.at[own])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    _stream_queries(p, ring, q_ref, do_ref, rows_ref, bi, kv_head)


def dkv_halves_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref,
                      spans_ref, dk_ref, dv_ref, k_halves, v_halves, q_smem, do_smem,
                      rows_smem, kv_loaded, q_loaded, do_loaded, rows_loaded, q_free,
                      computed):
  """dk/dv at head dims above 128: a program owns block_kv keys, and each
  compute warpgroup accumulates one half of dk's and dv's columns (128 each),
  since a warpgroup's whole dk and dv of 64 keys would take 256 registers per
  thread. Both compute the scores and dp over the whole head dim: 3 tile
  matmuls of 64 x 256 per warpgroup and step where the split by keys does 2.
  K and V sit in shared memory as two column halves, so that each
  warpgroup's dk and dv go out from a contiguous buffer."""
  plgpu = common.plgpu()
  bq, bkv, group = p.shape.block_q, p.shape.block_kv, p.group
  bi = lax.axis_index("batch")
  kv_head = lax.axis_index("heads")
  tile = lax.axis_index("kv_tiles")
  wg = lax.axis_index("wg")
  k_start = tile * bkv
  tiles = q_tiles(p.spec_padded, k_start, bq, bkv, p.padded,
                  *tile_span(spans_ref, bi, tile))
  lo, hi = program_tiles(tiles)
  tiles = own_tiles(tiles, lo, hi)
  ring = _QueryRing(lo * group, hi * group, q_smem, do_smem, rows_smem, q_loaded, do_loaded,
                    rows_loaded, q_free)
  own = (bi, pl.ds(k_start, bkv), kv_head)

  def compute(part):
    if part == 0:  # one warpgroup loads the shared K and V halves
      _load_halves((k_ref, v_ref), (k_halves, v_halves), own, kv_loaded, p.shape.half)
    for i in range(4):
      plgpu.barrier_wait(kv_loaded.at[i])

    def step(qb, g, carry, masked):
      return _dkv_step(p, ring, k_halves, v_halves, part, seg_ref, bi, k_start, qb, g, carry,
                       masked)

    dk, dv = tile_loop(tiles, _group_steps(p, step),
                       (_zero_gradient(bkv, p.shape.half, range_scaled(p.shape.dtype)),
                        _zero_gradient(bkv, p.shape.half)))
    _store_halves(p, part, computed,
                  [(k_halves, dk_ref, _gradient(dk)), (v_halves, dv_ref, dv)], own)

  _run_halves(wg, compute, lambda: _stream_queries(p, ring, q_ref, do_ref, rows_ref, bi,
                                                   kv_head))


# --- the call ---------------------------------------------------------------------------

def backward(spec: StaticSpec, tiles: MosaicTiles, q, k, v, seg, temp, shift, delta, dout, *,
             fast_cap: bool, kernels=("dq", "dkv")):
  """(dq, dk, dv) of the unpadded inputs. ``shift`` [B, Hq, T] is the forward's
  row statistic (SoftmaxState.finalize without low), ``delta`` [B, Hq, T] = rowsum(dO * O) - dlse - w * lse (0 on rows
  without a visible key), ``temp`` [B, T, Hq] float32 or None. ``kernels``
  runs only some of the two (the others' outputs are None), so that
  benchmarks.breakdown times each on its own."""
  b, t, hq, d = q.shape
  hkv = k.shape[2]
  dtype = q.dtype
  halves = d > HALVES_ABOVE
  head_dim = 2 * HALVES_ABOVE if halves else common.padded_head_dim(d)
  seq_pad = common.padded_length(t, 2 * tiles.block_q_dq, tiles.block_kv_dq,
                                        tiles.block_q_dkv, 2 * tiles.block_kv_dkv)
  has_seg, has_temp = seg is not None, temp is not None

  q, k, v, dout = (pad(x, {1: seq_pad, 3: head_dim}) for x in (q, k, v, dout))
  # Each kernel reads the spans of its warpgroups' tiles (query tiles for dq,
  # key tiles for dk/dv); one array where both tiles have the same length.
  spans = {block: tile_ranges(seg, seq_pad, block) if has_seg else None
           for block in {tiles.block_q_dq, tiles.block_kv_dkv}}
  spans_dq, spans_dkv = spans[tiles.block_q_dq], spans[tiles.block_kv_dkv]
  seg = pad(seg, {1: seq_pad}) if has_seg else None
  # Per-query rows of each head, [B, Hq, R, T_pad]: the dk/dv kernel's TMA
  # warpgroup copies a query tile's lse, delta (and temperature) at once.
  row_vectors = [shift, delta] + ([jnp.transpose(temp, (0, 2, 1))] if has_temp else [])
  rows = pad(jnp.stack([x.astype(jnp.float32) for x in row_vectors], axis=2), {3: seq_pad})
  dq_shape, dkv_shape = tile_shapes(tiles, dtype, head_dim, num_rows=rows.shape[2],
                                    halves=halves)
  params = functools.partial(
      BackwardParams, spec,
      # Tile ranges count tiles over the padded length; masks use spec's own
      # seq_len (visible_mask's padded flag hides the padding).
      dataclasses.replace(spec, seq_len=seq_pad), seq_pad != t, has_temp, fast_cap)
  # A halves program owns one tile (each warpgroup half its columns), a
  # program of the others two tiles (one per warpgroup).
  per_program = 1 if halves else 2
  call = functools.partial(common.warp_specialized_call, spec=spec, fast_cap=fast_cap)
  dq_call = call(
      functools.partial(dq_halves_kernel if halves else dq_kernel, params(dq_shape)),
      out_type=jax.ShapeDtypeStruct(q.shape, dtype),
      scratch_types=dq_scratch(dq_shape),
      grid=(hq, seq_pad // (per_program * dq_shape.block_q), b),
      grid_names=("heads", "q_tiles", "batch"),
      kernel_name="ua_backward_dq_halves_mosaic" if halves else "ua_backward_dq_mosaic",
  )
  dkv_call = call(
      functools.partial(dkv_halves_kernel if halves else dkv_kernel, params(dkv_shape)),
      out_type=(jax.ShapeDtypeStruct(k.shape, dtype),) * 2,
      scratch_types=dkv_scratch(dkv_shape),
      grid=(hkv, seq_pad // (per_program * dkv_shape.block_kv), b),
      grid_names=("heads", "kv_tiles", "batch"),
      kernel_name="ua_backward_dkv_halves_mosaic" if halves else "ua_backward_dkv_mosaic",
  )
  dq = dk = dv = None
  with fast_math.native("mosaic"):
    if "dq" in kernels:
      dq = dq_call(q, k, v, dout, rows, seg, spans_dq)[:, :t, :, :d]
    if "dkv" in kernels:
      dk, dv = (x[:, :t, :, :d] for x in dkv_call(q, k, v, dout, rows, seg, spans_dkv))
  return dq, dk, dv
