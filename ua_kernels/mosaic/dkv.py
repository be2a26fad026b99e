"""The Mosaic backward's dk/dv kernels (ua_kernels.mosaic.backward): a program
owns key rows and streams the queries of its GQA group."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import (RingCopy, load_vector, own_tiles, position_tiles, program_spans,
                     program_tiles, ring_slot, tile_logits, tile_span)
from ..tile_math import (dither_bits, logits_grad, matmul_operand, probabilities, q_tiles,
                         range_scaled, tile_loop, to_operand, unbiased_roundings)
from .backward_parts import (BackwardParams, _accumulate, _gradient, _load_halves, _own_parts,
                             _query_rows, _ring_columns, _run_halves, _scores_pair, _store_halves,
                             _zero_gradient)


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
              qb, g, carry, masked, share=None):
  """One step of a dk/dv warpgroup (query tile ``qb`` of the group's query
  head ``g``): sT = K Q^T and dpT = V dO^T, then dv += pT dO and dk += dsT Q,
  over the whole head dim (``part`` None) or the gradients' column half
  ``part`` (``k_own``/``v_own`` then hold both halves). ``share`` (the fused
  kernel's _DqShare) then sends this step's ds K to dq."""
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
  plgpu.barrier_arrive(ring.q_free.at[s])  # the step's Q and dO are read; ds K needs neither
  if share is not None:
    share.send(p, ds16, k_own, bi, qb, g)
  return dk, dv


def _group_steps(p: BackwardParams, step):
  """tile_loop's visit of a query tile: ``step(qb, g, carry, masked)`` for
  every query head g of the group."""
  def query_tile(qb, carry, masked):
    return lax.fori_loop(0, p.group, lambda g, c: step(qb, g, c, masked), carry)
  return query_tile


class _DqShare(NamedTuple):
  """The fused kernel's dq: the float32 accumulator [B, T, Hq, D] in global
  memory, and one compute warpgroup's ds tile ([block_kv, block_q], 16-bit)
  and dq share ([block_q, D], float32) in shared memory. ``order``: None (the
  adds in the order they arrive), or (counters [B, Hq, query tiles] in global
  memory, zeroed, and this warpgroup's rank among its kv head's compute
  warpgroups): each warpgroup takes its turn at every counter, adding its share
  or not, so that a tile's shares are added in the ranks' order."""
  dq_ref: Any
  kv_head: Any
  ds_smem: Any
  out_smem: Any
  order: Any = None

  def send(self, p: BackwardParams, ds16, k_own, bi, qb, g):
    """dq[query tile ``qb``, head g of the group] += ds K, ``ds16`` the
    operand of dk's product (bfloat16: not range-scaled, so the same operand
    serves both). It goes through shared memory, where wgmma reads it
    transposed (its rows, the keys, are the product's inner dimension); the
    share is added into global memory by a TMA reduce-add."""
    plgpu = common.plgpu()
    bq = p.shape.block_q
    self.ds_smem[...] = ds16
    plgpu.commit_smem()

    def product(acc):
      plgpu.wgmma(acc, self.ds_smem.transpose((1, 0)), k_own)
      return acc[...]

    share = pl.run_scoped(product, plgpu.ACC((bq, p.shape.head_dim), jnp.float32))
    head = self.kv_head * p.group + g
    if self.order is None:  # ordered, the last add has landed before its turn passed
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last share has left out_smem
    self.out_smem[...] = share
    plgpu.commit_smem()
    counter = None if self.order is None else self._await_turn(bi, head, qb)
    plgpu.copy_smem_to_gmem(self.out_smem, self.dq_ref.at[bi, pl.ds(qb * bq, bq), head],
                            reduction_op="add")
    if counter is not None:
      plgpu.wait_smem_to_gmem(0, wait_read_only=False)  # added, not only read
      pl.semaphore_signal(counter, 1)

  def pass_turn(self, p: BackwardParams, bi, n):
    """Step n (query tile n // group, head n % group), which adds nothing
    here: its turn taken and passed on, where ordered."""
    if self.order is not None:
      head = self.kv_head * p.group + lax.rem(n, jnp.int32(p.group))
      pl.semaphore_signal(self._await_turn(bi, head, lax.div(n, jnp.int32(p.group))), 1)

  def pass_turns(self, p: BackwardParams, bi, start, stop):
    """pass_turn of steps [start, stop)."""
    if self.order is not None:
      lax.fori_loop(start, stop, lambda n, carry: self.pass_turn(p, bi, n), None)

  def _await_turn(self, bi, head, q_tile):
    counters, rank = self.order
    counter = counters.at[bi, head, q_tile]
    pl.semaphore_wait(counter, rank, decrement=False)  # every lower rank has passed
    return counter


def dkv_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref,
               dk_ref, dv_ref, *scratch):
  """dk/dv: a program owns 2 * block_kv keys of one kv head, each compute
  warpgroup one tile of block_kv; the memory warpgroup streams the query
  tiles of the hull of their ranges, for every query head of the group."""
  _dkv_program(p, (q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref), dk_ref, dv_ref,
               scratch, None)


def dkv_dq_kernel(p: BackwardParams, q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref,
                  spans_ref, dq_ref, dk_ref, dv_ref, *scratch, ordered: bool = False):
  """The fused backward: dkv_kernel's program, whose steps also add their ds K
  into ``dq_ref``, a zeroed float32 [B, T, Hq, D] (_DqShare): five tile
  products a step where the dq and dk/dv kernels take seven, dq's sums in the
  order the hardware takes, or ``ordered``, in the order of the key tiles
  (fused_scratch has the two extra buffers)."""
  if range_scaled(p.shape.dtype):  # dk's ds operand is scaled per key: not dq's
    raise ValueError("the fused backward takes bfloat16 (backward_parts.fused_unsupported)")
  *scratch, ds_smem2, out_smem2 = scratch
  counters = None
  if ordered:  # one per dq tile, zeroed at each launch; every program's the same
    b, seq_pad, hq, _ = dq_ref.shape
    counters = pl.get_global(common.plgpu().SemaphoreType.REGULAR(
        (b, hq, seq_pad // p.shape.block_q)))
  _dkv_program(p, (q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref), dk_ref, dv_ref,
               scratch, (dq_ref, ds_smem2, out_smem2, counters))


def _dkv_program(p: BackwardParams, refs, dk_ref, dv_ref, scratch, dq):
  """dkv_kernel's program; ``dq``: None, or the fused kernel's (accumulator,
  ds buffers, share buffers, counters or None)."""
  q_ref, k_ref, v_ref, do_ref, rows_ref, seg_ref, spans_ref = refs
  (k_smem2, v_smem2, q_smem, do_smem, rows_smem,
   k_loaded, v_loaded, q_loaded, do_loaded, rows_loaded, q_free) = scratch
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

    share = None
    if dq is not None:
      # Rank 2 * tile + wg: programs start in the order of their key tiles, so
      # no turn waits on a program that has not started.
      order = None if dq[3] is None else (dq[3], 2 * tile + wg)
      share = _DqShare(dq[0], kv_head, dq[1].at[wg], dq[2].at[wg], order)

    def drain(n, carry):
      s = ring_slot(n, first, p.shape.stages)
      plgpu.barrier_wait(q_loaded.at[s])
      plgpu.barrier_wait(do_loaded.at[s])
      plgpu.barrier_wait(rows_loaded.at[s])
      plgpu.barrier_arrive(q_free.at[s])
      if share is not None:
        share.pass_turn(p, bi, n)
      return carry

    def step(qb, g, carry, masked):
      return _dkv_step(p, ring, k_smem, v_smem, None, seg_ref, bi, k_start, qb, g, carry,
                       masked, share)

    zeros = (_zero_gradient(bkv, p.shape.head_dim, range_scaled(p.shape.dtype)),
             _zero_gradient(bkv, p.shape.head_dim))
    tiles = own_tiles(q_tiles(
        p.spec_padded, k_start, bq, bkv, p.padded,
        own_span, own_uniform), cta_lo, cta_hi)
    if share is not None:  # the steps of query tiles outside the program's range
      share.pass_turns(p, bi, 0, first)
    carry = lax.fori_loop(first, tiles.lo * group, drain, zeros)
    carry = tile_loop(tiles, _group_steps(p, step), carry)
    dk, dv = lax.fori_loop(tiles.hi * group, last, drain, carry)
    if share is not None:
      share.pass_turns(p, bi, last, p.spec_padded.seq_len // bq * group)
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

