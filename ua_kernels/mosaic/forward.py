"""The forward kernel on Pallas Mosaic GPU, for Hopper (sm90): TMA copies, wgmma,
and warpgroup specialisation, which Pallas-Triton does not emit.

``forward`` pads the inputs and calls ``forward_kernel`` with a ForwardParams
(the kernel's static parameters) and the scratch of ``forward_scratch``
(both in forward_program.py, with the work items).

Structure of JAX's ``attention_mgpu.py`` forward: a work item is 2 * block_q
query rows of one (batch, query head); three warpgroups share a program. Two
compute warpgroups own block_q rows each (``_forward_compute``, one key tile of
it ``_forward_step``); the third only issues TMA copies of key and value tiles
into a ring of ``stages`` shared-memory slots (common.ring_steps),
guarded by a "loaded" barrier per slot (TMA arrives) and a "free" one (both
compute warpgroups arrive). A schedule barrier alternates the compute
warpgroups, so one's softmax overlaps the other's matmuls; with
MosaicTiles.overlap_softmax each warpgroup instead overlaps a tile's softmax
with its own previous tile's P @ V (``_overlapped_tiles``), unscheduled.

A program owns one work item (the grid is heads x q tiles x batch) or, with
MosaicTiles.persistent, is one of a multiprocessor count of programs that take
items in turn (forward_program.work), as tokamax's sm90 forward does where items are of
equal work (the tuned table runs it wherever there is no causal mask or window,
packed documents included: mosaic.tuned.mosaic_tiles): the ring's slots run
on across items, so the next item's first K/V tiles load while this one ends,
and its Q copy is issued as soon as this item's last product has read Q's
buffer, before O is written out (through O's own buffer where the shared memory
holds one, else through Q's, after which Q is copied). What it gained: docs/BENCHMARKS.md.

Every masking and capping rule comes from tile_math, as in the Triton kernels:
the logits are tile_math.scores_to_logits of the wgmma's scores, the mask is
tile_math.visible_mask of position tiles (both through common.tile_logits,
shared with the backward kernels), the online softmax is
SoftmaxState.step, and the key-tile ranges are tile_math.kv_tiles (causal and
window tiles outside the band, and with segment ids the tiles outside the spans
of a tile's documents, are never loaded; the fully visible ones run without a
mask, and those inside the query tile's run of one segment id are masked by
position only, without reading the ids). The memory warpgroup loads the hull
of both compute warpgroups' ranges; a compute warpgroup passes over tiles of that hull that
are outside its own range ("drain": it waits for and releases the slot, and
keeps the schedule barrier's count), since a barrier's phase is tracked by
each waiting thread and must not be skipped.

Outputs what the Triton forward does (out, base-2 lse per row), so either
backend's backward runs on this forward's residuals.
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

from .. import devices, fast_math
from . import common
from .common import RingCopy, load_vector, own_tiles, ring_slot, tile_logits
from .config import MosaicTiles
from .forward_program import (USED_SUM_COLUMNS, ForwardParams, Item, forward_scratch,
                              over_items, scratch_of, work)
from ..padding import pad
from ..segment_spans import tile_ranges
from ..softmax_state import SoftmaxState, sums_rounded
from ..tile_math import LOG2E, exp2_scale, fixed_shift, kv_tiles, tile_loop

# 256 is the largest head dim whose tiles fit the shared memory.
MAX_HEAD_DIM = 256


def unsupported(spec: StaticSpec, dtype) -> str | None:
  """Why the Mosaic forward cannot run this call (None: it can)."""
  if why := common.dtype_error(dtype):
    return why
  if spec.head_dim > MAX_HEAD_DIM:
    return f"the Mosaic backend takes head dims up to {MAX_HEAD_DIM}, not {spec.head_dim}"
  return None


def forward_kernel(p: ForwardParams, q_ref, k_ref, v_ref, seg_ref, spans_ref, temp_ref,
                   ones_ref, sink_ref, offset_ref, out_ref, lse_ref, *scratch_refs):
  """One program: warpgroups 0 and 1 compute (_forward_compute), 2 streams the
  key and value tiles of the hull of their ranges (common.ring_steps),
  for each of the program's work items (forward_program.work). ``ones_ref`` and the ones'
  scratch only with ``p.rounded_sum``; ``sink_ref`` [Hq, block_q] (each head's
  sink in the scores' units, a row of one value) only with ``p.has_sinks``;
  ``offset_ref`` [1] int32 (the queries' offset among the keys' positions) or
  None for 0."""
  plgpu = common.plgpu()
  sc = scratch_of(p, scratch_refs)
  wg = lax.axis_index("wg")
  count, item_of = work(p, spans_ref, wg, None if offset_ref is None else offset_ref[0])

  def ring(item, base):
    return _Ring(item.lo, item.hi, item.lo - base, sc.k_smem, sc.v_smem, sc.k_loaded,
                 sc.v_loaded, sc.k_free, sc.v_free, sc.schedule)

  @pl.when(wg < 2)
  def _compute():
    plgpu.set_max_registers(232, action="increase")
    ones_smem = None
    if p.rounded_sum:
      ones_smem = sc.ones_smem2.at[wg]
      plgpu.copy_gmem_to_smem(ones_ref, ones_smem, sc.ones_loaded.at[wg])
      plgpu.barrier_wait(sc.ones_loaded.at[wg])
    q_smem, q_loaded = sc.q_smem2.at[wg], sc.q_loaded.at[wg]

    def load_q(item):
      q_start = item.tile * p.rows + wg * p.block_q
      plgpu.copy_gmem_to_smem(q_ref.at[item.bi, pl.ds(q_start, p.block_q), item.h], q_smem,
                              q_loaded)

    if p.programs:
      pl.when(count > 0)(lambda: load_q(item_of(0)))
    else:
      load_q(item_of(0))

    def compute(i, item, base):
      def load_next_q():  # called by persistent programs only
        pl.when(i + 1 < count)(lambda: load_q(item_of(i + 1)))
      _forward_compute(p, ring(item, base), seg_ref, temp_ref, sink_ref, out_ref, lse_ref,
                       q_smem, sc.out_smem2.at[wg], sc.lse_smem2.at[wg], q_loaded, ones_smem,
                       item, wg, load_next_q)

    over_items(count, item_of, compute)
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 2)
  def _memory():
    plgpu.set_max_registers(40, action="decrease")
    groups = [
        (sc.k_free, [RingCopy(lambda rows_of: k_ref.at[rows_of], sc.k_smem, sc.k_loaded)]),
        (sc.v_free, [RingCopy(lambda rows_of: v_ref.at[rows_of], sc.v_smem, sc.v_loaded)]),
    ]

    def stream(i, item, base):
      del i
      def locate(kb):
        return (item.bi, pl.ds(kb * p.block_kv, p.block_kv), item.kv_head)
      common.ring_steps(item.lo, item.hi, item.lo - base, p.stages, locate, groups)

    common.ring_observe(over_items(count, item_of, stream), p.stages, groups)


class _Ring(NamedTuple):
  """An item's key-tile range [lo, hi) and the ring of K and V slots, whose
  step 0 is ``origin`` (the program's earlier items streamed lo - origin
  steps)."""
  lo: Any
  hi: Any
  origin: Any
  k_smem: Any
  v_smem: Any
  k_loaded: Any
  v_loaded: Any
  k_free: Any
  v_free: Any
  schedule: Any


def _forward_compute(p: ForwardParams, ring: _Ring, seg_ref, temp_ref, sink_ref, out_ref,
                     lse_ref, q_smem, out_smem, lse_smem, q_loaded, ones_smem, item: Item, wg,
                     load_next_q):
  """Compute warpgroup ``wg`` on one item: the online softmax of its block_q
  rows (their Q copy issued before) over its own key tiles, draining the
  item's tiles outside them, then O and lse out. ``load_next_q`` issues the
  next item's Q copy as soon as Q's buffer is free."""
  plgpu = common.plgpu()
  block_q, block_kv = p.block_q, p.block_kv
  bi, h = item.bi, item.h
  q_start = item.tile * p.rows + wg * block_q
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  q_temp = (load_vector(temp_ref.at[bi, h, pl.ds(q_start, block_q)], row_layout)
            if p.has_temp else None)
  plgpu.barrier_wait(q_loaded)

  def schedule_sync():
    if not p.overlap_softmax:  # the overlapped forward takes no schedule barrier
      _schedule_sync(ring.schedule)

  def drain(kb, carry):
    # As many schedule syncs per tile as a visited tile has.
    s = ring_slot(kb, ring.origin, p.stages)
    plgpu.barrier_wait(ring.k_loaded.at[s])
    plgpu.barrier_arrive(ring.k_free.at[s])
    schedule_sync()
    plgpu.barrier_wait(ring.v_loaded.at[s])
    plgpu.barrier_arrive(ring.v_free.at[s])
    schedule_sync()
    return carry

  row = _Row(q_smem, ones_smem, seg_ref, bi, q_start, q_temp, item.delta)

  def visit(kb, state, masked):
    return _forward_step(p, ring, row, kb, state, masked)

  state = SoftmaxState(
      plgpu.layout_cast(jnp.full((block_q,), -jnp.inf if p.shift is None else p.shift,
                                 jnp.float32), row_layout),
      plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32), row_layout),
      plgpu.layout_cast(jnp.zeros((block_q, p.head_dim), jnp.float32), plgpu.Layout.WGMMA),
      plgpu.layout_cast(jnp.zeros((block_q, USED_SUM_COLUMNS), jnp.float32),
                        plgpu.Layout.WGMMA) if p.rounded_sum else None)
  tiles = own_tiles(kv_tiles(
      p.spec_padded, q_start, block_q, block_kv, p.padded,
      item.own_span, item.own_uniform, delta=item.delta), ring.lo, ring.hi)
  pl.when(wg == 1)(schedule_sync)
  state = lax.fori_loop(ring.lo, tiles.lo, drain, state)
  if p.overlap_softmax:
    state = _overlapped_tiles(p, ring, row, tiles, state)
  else:
    state = tile_loop(tiles, visit, state)
  state = lax.fori_loop(tiles.hi, ring.hi, drain, state)
  pl.when(wg == 0)(schedule_sync)

  scale = exp2_scale(p.spec, p.has_temp)
  if p.has_sinks:
    state = state.with_sink(load_vector(sink_ref.at[h], row_layout), scale)
  out, shift, _ = state.finalize(scale)
  if p.programs:
    if p.separate_out:
      # Every product reading Q's buffer has completed: the last QK^T's scores
      # were read out of its accumulator, which waits for the wgmma.
      load_next_q()
    # The previous item's stores have read O's and lse's buffers.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  out_smem[...] = out.astype(p.dtype)
  lse_smem[...] = shift
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(out_smem, out_ref.at[bi, pl.ds(q_start, block_q), h])
  plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[bi, h, pl.ds(q_start, block_q)])
  if p.programs and not p.separate_out:
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # O has left Q's buffer
    load_next_q()


def _schedule_sync(schedule):
  """Arrive at and wait for the schedule barrier, which alternates the two
  compute warpgroups."""
  plgpu = common.plgpu()
  plgpu.barrier_arrive(schedule)
  plgpu.barrier_wait(schedule)


class _Row(NamedTuple):
  """What every key tile of one compute warpgroup's rows reads: its Q tile,
  the ones tile (None without ``rounded_sum``), the segment ids, the batch,
  the first row, the rows' temperatures (None without) and Item's delta."""
  q_smem: Any
  ones_smem: Any
  seg_ref: Any
  bi: Any
  q_start: Any
  q_temp: Any
  delta: Any


def _forward_step(p: ForwardParams, ring: _Ring, row: _Row, kb, state, masked):
  """One key tile: s = Q K^T, the online softmax step, acc += p V (and, with
  ``rounded_sum``, l_used += p @ ones on the tensor cores: the rounded row sum
  at 8 columns against P @ V's head_dim, not a second cross-lane sum per tile,
  whose cost docs/DEFECTS.md, B33, measured); the schedule barrier between the
  two matmuls hands the tensor cores to the other compute warpgroup."""
  plgpu = common.plgpu()
  s = ring_slot(kb, ring.origin, p.stages)
  m, l, correction, probs = _softmax_of_tile(p, ring, row, kb, state, masked)
  acc = state.rescaled_acc(correction)
  used = state.rescaled_used(correction)
  probs = probs.astype(p.dtype)
  plgpu.barrier_arrive(ring.schedule)
  plgpu.barrier_wait(ring.v_loaded.at[s])
  plgpu.barrier_wait(ring.schedule)
  return _probs_times_values(p, ring, row, s, SoftmaxState(m, l, acc, used), probs)


def _softmax_of_tile(p: ForwardParams, ring: _Ring, row: _Row, kb, state, masked):
  """Key tile ``kb``'s s = Q K^T (the schedule barrier taken while it runs,
  but in the overlapped forward) and softmax step (SoftmaxState.step)."""
  plgpu = common.plgpu()
  s = ring_slot(kb, ring.origin, p.stages)
  plgpu.barrier_wait(ring.k_loaded.at[s])

  def qk(acc_ref):
    plgpu.wgmma(acc_ref, row.q_smem, ring.k_smem.at[s].transpose((1, 0)))
    if not p.overlap_softmax:
      _schedule_sync(ring.schedule)
    return acc_ref[...]

  scores = pl.run_scoped(qk, plgpu.ACC((p.block_q, p.block_kv), jnp.float32))
  plgpu.barrier_arrive(ring.k_free.at[s])
  return _softmax_step(p, row, kb, state, scores, masked)


def _softmax_step(p: ForwardParams, row: _Row, kb, state, scores, masked):
  logits = tile_logits(p.spec, scores, row.q_temp, row.q_start, kb * p.block_kv,
                       masked=masked, seg_ref=row.seg_ref, batch=row.bi, padded=p.padded,
                       fast_cap=p.fast_cap, delta=row.delta)
  return state.step(logits, p.shift)


def _probs_times_values(p: ForwardParams, ring: _Ring, row: _Row, s, state, probs):
  """acc += probs @ V of ring slot ``s`` (and l_used += probs @ ones), its V
  loaded; the slot's V released once the product has run."""
  plgpu = common.plgpu()

  def pv(acc_refs):
    plgpu.wgmma(acc_refs[0], probs, ring.v_smem.at[s])
    if state.l_used is not None:
      plgpu.wgmma(acc_refs[1], probs, row.ones_smem.transpose((1, 0)))

  accs = pl.run_state(pv)(tuple(plgpu.ACC.init(x) for x in (state.acc, state.l_used)
                                if x is not None))
  plgpu.barrier_arrive(ring.v_free.at[s])
  return SoftmaxState(state.m, state.l, accs[0], accs[1] if len(accs) > 1 else None)


def _overlapped_tiles(p: ForwardParams, ring: _Ring, row: _Row, tiles, state):
  """tile_loop's work with FlashAttention-3's intra-warpgroup overlap: the
  first tile's Q K^T and softmax alone, then for each further tile its Q K^T
  issued together with the previous tile's P @ V, whose product runs on while
  this tile's softmax is computed (_overlapped_step), then the last tile's
  P @ V. The same products and roundings in the same order as tile_loop's
  (each P @ V still adds to the accumulator its tile's correction scaled),
  so the same bits. The first tile's mask kind is known at run time only: a
  switch over the kinds, and a branch for a warpgroup without tiles."""
  plgpu = common.plgpu()
  kind = sum(lax.convert_element_type(bound <= tiles.lo, jnp.int32)
             for bound in tiles.bounds[1:])
  no_probs = plgpu.layout_cast(jnp.zeros((p.block_q, p.block_kv), p.dtype),
                               plgpu.Layout.WGMMA)

  def first_tile(masked):
    def branch(state):
      m, l, correction, probs = _softmax_of_tile(p, ring, row, tiles.lo, state, masked)
      return SoftmaxState(m, l, state.rescaled_acc(correction),
                          state.rescaled_used(correction)), probs.astype(p.dtype)
    return branch

  state, probs = lax.switch(kind, [*map(first_tile, tiles.masks), lambda st: (st, no_probs)],
                            state)

  def visit(kb, carry, masked):
    return _overlapped_step(p, ring, row, kb, carry, masked)

  state, probs = tile_loop(own_tiles(tiles, tiles.lo + 1, tiles.hi), visit, (state, probs))

  def last_product():
    s = ring_slot(tiles.hi - 1, ring.origin, p.stages)
    plgpu.barrier_wait(ring.v_loaded.at[s])
    return _probs_times_values(p, ring, row, s, state, probs)

  return lax.cond(tiles.lo < tiles.hi, last_product, lambda: state)


def _overlapped_step(p: ForwardParams, ring: _Ring, row: _Row, kb, carry, masked):
  """Key tile ``kb`` given the previous tile's probabilities: issue its Q K^T,
  then the previous tile's P @ V (and P @ ones), wait for the scores only
  (wgmma groups complete in order) and compute the softmax step while the
  P @ V runs, then wait for it and rescale."""
  plgpu = common.plgpu()
  state, probs_prev = carry
  s = ring_slot(kb, ring.origin, p.stages)
  s_prev = ring_slot(kb - 1, ring.origin, p.stages)
  plgpu.barrier_wait(ring.k_loaded.at[s])
  plgpu.barrier_wait(ring.v_loaded.at[s_prev])
  with_used = state.l_used is not None

  def products(scores_ref, acc_ref, used_ref=None):
    acc_ref[...] = state.acc
    if with_used:
      used_ref[...] = state.l_used
    plgpu.wgmma(scores_ref, row.q_smem, ring.k_smem.at[s].transpose((1, 0)))
    plgpu.wgmma(acc_ref, probs_prev, ring.v_smem.at[s_prev])
    if with_used:
      plgpu.wgmma(used_ref, probs_prev, row.ones_smem.transpose((1, 0)))
    scores = plgpu.wgmma_accumulator_load(scores_ref, wait_n=2 if with_used else 1)
    plgpu.barrier_arrive(ring.k_free.at[s])
    m, l, correction, probs = _softmax_step(p, row, kb, state, scores, masked)
    done = SoftmaxState(m, l, acc_ref[...], used_ref[...] if with_used else None)
    plgpu.barrier_arrive(ring.v_free.at[s_prev])
    return SoftmaxState(m, l, done.rescaled_acc(correction),
                        done.rescaled_used(correction)), probs.astype(p.dtype)

  accumulators = [plgpu.ACC((p.block_q, p.block_kv), jnp.float32),
                  plgpu.ACC((p.block_q, p.head_dim), jnp.float32)]
  if with_used:
    accumulators.append(plgpu.ACC((p.block_q, USED_SUM_COLUMNS), jnp.float32))
  return pl.run_scoped(products, *accumulators)


def forward(spec: StaticSpec, tiles: MosaicTiles, q, k, v, seg, temp, *, fast_cap: bool,
            sinks=None, offset=None):
  """(out [B, Tq, Hq, D], shift [B, Hq, Tq]: SoftmaxState.finalize's row
  statistic, without low) of the unpadded inputs;
  ``seg`` [B, T] int32 or None (equal lengths, no offset); ``temp`` [B, Tq, Hq]
  float32 or None; ``sinks`` [Hq] (natural units, docs/SEMANTICS.md) or None;
  ``offset`` an int32 scalar, traced or not, how far the queries' positions
  lie after the keys' (the contract's q_offset), or None for 0. Keys of
  another length pad to their own tiles, the queries to theirs."""
  b, t, hq, d = q.shape
  t_kv = k.shape[1]
  if seg is not None and (t_kv != t or offset is not None):
    raise ValueError("the Mosaic forward takes segment ids only with the queries' own keys "
                     "(equal lengths, no offset)")
  dtype = q.dtype
  head_dim = common.padded_head_dim(d)
  rows = 2 * tiles.block_q
  if t_kv == t:
    seq_pad = kv_pad = common.padded_length(t, rows, tiles.block_kv)
  else:
    seq_pad, kv_pad = common.padded_length(t, rows), common.padded_length(t_kv, tiles.block_kv)
  has_seg, has_temp = seg is not None, temp is not None
  p = ForwardParams(
      spec=spec,
      # kv_tiles/kv_block_range count tiles over the padded length; masks use
      # spec's own seq_len (visible_mask's padded flag hides the padding).
      spec_padded=dataclasses.replace(spec, seq_len=seq_pad, kv_seq_len=kv_pad),
      dtype=dtype, block_q=tiles.block_q, block_kv=tiles.block_kv, head_dim=head_dim,
      stages=min(tiles.stages, kv_pad // tiles.block_kv), padded=(seq_pad, kv_pad) != (t, t_kv),
      has_temp=has_temp, shift=fixed_shift(spec, dtype, has_temp), fast_cap=fast_cap,
      rounded_sum=sums_rounded(spec, dtype), q_tiles=seq_pad // rows,
      overlap_softmax=tiles.overlap_softmax, has_sinks=sinks is not None)
  if tiles.persistent:
    p = dataclasses.replace(p, programs=min(devices.multiprocessors(), p.items))
    with_out = dataclasses.replace(p, separate_out=True)
    if common.scratch_bytes(forward_scratch(with_out)) <= common.MAX_SHARED_MEMORY:
      p = with_out

  q = pad(q, {1: seq_pad, 3: head_dim})
  k, v = (pad(x, {1: kv_pad, 3: head_dim}) for x in (k, v))
  spans = tile_ranges(seg, seq_pad, p.block_q) if has_seg else None
  seg = pad(seg, {1: seq_pad}) if has_seg else None
  temp = pad(jnp.transpose(temp, (0, 2, 1)), {2: seq_pad}) if has_temp else None
  ones = jnp.ones((USED_SUM_COLUMNS, p.block_kv), dtype) if p.rounded_sum else None
  # Natural units to the scores': base 2, then the exp2's scale (as the Triton forward).
  sink_rows = None if sinks is None else jnp.broadcast_to(
      (sinks.astype(jnp.float32) * (LOG2E / exp2_scale(spec, has_temp)))[:, None],
      (hq, p.block_q))
  call = common.warp_specialized_call(
      functools.partial(forward_kernel, p),
      spec=spec, fast_cap=fast_cap,
      out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                jax.ShapeDtypeStruct((b, hq, seq_pad), jnp.float32)),
      scratch_types=forward_scratch(p),
      **(dict(grid=(p.programs,), grid_names=("programs",)) if p.programs else
         dict(grid=(hq, p.q_tiles, b), grid_names=("heads", "q_tiles", "batch"))),
      kernel_name="ua_forward_mosaic",
  )
  with fast_math.native("mosaic"):
    out, shift = call(q, k, v, seg, spans, temp, ones, sink_rows,
                      None if offset is None else jnp.reshape(jnp.asarray(offset, jnp.int32), (1,)))
  return out[:, :t, :, :d], shift[:, :, :t]
