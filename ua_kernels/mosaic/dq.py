"""The Mosaic backward's dq kernels (ua_kernels.mosaic.backward): a program
owns query rows and streams the keys."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import common
from .common import (RingCopy, launched_q_tile, load_vector, own_tiles, position_tiles,
                     program_spans, program_tiles, ring_slot, tile_logits, tile_span)
from ..tile_math import (dither_bits, kv_tiles, logits_grad, matmul_operand, probabilities,
                         range_scaled, tile_loop, unbiased_roundings)
from .backward_parts import (BackwardParams, _accumulate, _gradient, _load_halves, _own_parts,
                             _query_rows, _ring_columns, _run_halves, _scores_pair, _store_halves,
                             _zero_gradient)


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

