"""The three Pallas kernels: forward, dq, and dk/dv (summed over a GQA group).

Refs arrive per (batch, head) through BlockSpecs: the tile a program owns is
loaded once, the other side is streamed in a fori_loop bounded by the block
ranges of tile_math, so causal/window-hidden tiles, and with segment ids the
tiles outside the spans of the tile's segments, are never visited.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from ..softmax_state import SoftmaxState, sums_rounded
from ..tile_math import (LOG2E, TileMask, dither_bits, dot, exp2_scale, fixed_shift, gradient_product,
                        kv_tiles, logits_grad, matmul_operand, position_grid, positions,
                        probabilities, q_tiles, scaled_back, tile_logits, tile_loop, to_operand,
                        unbiased_roundings, visible_mask)


def _segment_tile(seg_ref, start, size):
  return None if seg_ref is None else seg_ref[pl.ds(start, size)]


def _segment_span(span_ref, start, size):
  """(span, uniform) of the tile at ``start``, for tile_math.kv_tiles/q_tiles:
  [lo, hi) of the positions that share a segment with some position of the
  tile (segment_spans), and of the run of one id holding the whole tile,
  empty if none does (segment_runs); (None, None) without segment ids. The
  tile loops skip tiles outside the span (packed documents visit only the
  tiles of their own documents), read no segment ids for those inside the run,
  and run those also inside the causal/window band unmasked."""
  if span_ref is None:
    return None, None
  tile = lambda row: span_ref[row, pl.ds(start, size)]
  return (jnp.min(tile(0)), jnp.max(tile(1))), (jnp.max(tile(2)), jnp.min(tile(3)))


def _offset(offset_ref):
  """How far the queries' positions lie after the keys' (tile_math.visible_mask's delta),
  from its [1, 16] int32 block (a row of one value: Triton loads no scalars),
  or None: keys and queries of one sequence."""
  return None if offset_ref is None else jnp.max(offset_ref[...])


class _QueryTile(NamedTuple):
  """The query tile a forward or dq program owns, loaded once; ``offset`` as
  _offset gives it."""

  start: jax.Array
  q: jax.Array
  pos: jax.Array
  seg: jax.Array | None
  temp: jax.Array | None
  offset: jax.Array | None


def _query_tile(q_ref, seg_ref, temp_ref, offset_ref, block_q, splits: int = 1,
                rows_per_position: int = 1) -> _QueryTile:
  start = (pl.program_id(0) // splits) * block_q  # programs of one tile: its key splits
  pos = positions(start, block_q)
  if rows_per_position > 1:  # a GQA group's heads packed as rows (triton.decode)
    pos = pos // rows_per_position
  return _QueryTile(start, q_ref[...], pos,
                    _segment_tile(seg_ref, start, block_q),
                    None if temp_ref is None else temp_ref[...], _offset(offset_ref))


def _key_tile(spec, qt: _QueryTile, k_ref, seg_ref, kv_block, block_kv, padded, fast_cap,
              masked):
  """Loads key tile ``kv_block`` and scores it against the query tile:
  (k, logits), the mask built as ``masked`` (tile_loop's TileMask) says."""
  k_start = kv_block * block_kv
  k = k_ref[pl.ds(k_start, block_kv), :]
  mask = None
  if masked:
    by_segment = masked is TileMask.FULL
    mask = visible_mask(spec, qt.pos, positions(k_start, block_kv),
                        qt.seg if by_segment else None,
                        _segment_tile(seg_ref, k_start, block_kv) if by_segment else None,
                        padded=padded, delta=qt.offset)
  return k, tile_logits(spec, qt.q, k, qt.temp, mask, fast_cap)


def _value_tile(v_ref, kv_block, block_kv):
  return v_ref[pl.ds(kv_block * block_kv, block_kv), :]


def forward_kernel(q_ref, k_ref, v_ref, seg_ref, span_ref, temp_ref, kseg_ref, offset_ref,
                   sink_ref, o_ref, shift_ref, low_ref=None, *, spec: StaticSpec, block_q: int,
                   block_kv: int, padded: bool, fast_cap: bool, splits: int = 1,
                   rows_per_position: int = 1):
  """One query tile of one head: o = softmax(logits) @ v and each row's
  statistics, shift and (given ``low_ref``) low: SoftmaxState.finalize.
  ``kseg_ref``: the keys' own segment ids, ``offset_ref``: _offset's block,
  where the keys are another block of the sequence (None: the queries');
  ``sink_ref``: the head's sink logit, a [16] row of one value (or None).
  ``splits`` > 1: program i visits only split i % splits of the key tiles,
  a partial softmax that triton.decode combines (split-K);
  ``rows_per_position`` > 1: row r holds position r // rows_per_position (a
  GQA group's query heads packed as rows, triton.decode)."""
  qt = _query_tile(q_ref, seg_ref, temp_ref, offset_ref, block_q, splits, rows_per_position)
  key_seg_ref = seg_ref if kseg_ref is None else kseg_ref
  shift = fixed_shift(spec, q_ref.dtype, temp_ref is not None)

  def body(kv_block, state, masked):
    _, logits = _key_tile(spec, qt, k_ref, key_seg_ref, kv_block, block_kv, padded, fast_cap,
                          masked)
    return state.update(logits, _value_tile(v_ref, kv_block, block_kv), shift)

  if rows_per_position > 1:  # the tile's positions, first to last
    first = qt.start // rows_per_position
    count = (qt.start + block_q - 1) // rows_per_position + 1 - first
    tiles = kv_tiles(spec, first, count, block_kv, padded, delta=qt.offset)
  else:
    tiles = kv_tiles(spec, qt.start, block_q, block_kv, padded,
                     *_segment_span(span_ref, qt.start, block_q), delta=qt.offset)
  if splits > 1:
    chunk = -(-(-(-spec.kv_seq_len // block_kv)) // splits)
    split = pl.program_id(0) % splits
    tiles = tiles.clipped(split * chunk, (split + 1) * chunk)
  state = tile_loop(tiles, body, SoftmaxState.init(
      block_q, qt.q.shape[-1], shift, sums_rounded(spec, v_ref.dtype)))
  scale = exp2_scale(spec, temp_ref is not None)
  if sink_ref is not None:  # natural units to the scores': base 2, then the exp2's scale
    state = state.with_sink(jnp.max(sink_ref[...]) * (LOG2E / scale), scale)
  out, shift, low = state.finalize(scale, with_low=low_ref is not None)
  o_ref[...] = out.astype(o_ref.dtype)
  shift_ref[...] = shift
  if low_ref is not None:
    low_ref[...] = low


def dq_kernel(q_ref, k_ref, v_ref, seg_ref, span_ref, temp_ref, kseg_ref, offset_ref, do_ref,
              shift_ref, low_ref, delta_ref, dq_ref, *, spec: StaticSpec, block_q: int,
              block_kv: int, padded: bool, fast_cap: bool):
  """dq of one query tile of one head, streaming key tiles (kseg_ref,
  offset_ref: forward_kernel's)."""
  qt = _query_tile(q_ref, seg_ref, temp_ref, offset_ref, block_q)
  key_seg_ref = seg_ref if kseg_ref is None else kseg_ref
  do = do_ref[...]
  shift = shift_ref[...]
  low = None if low_ref is None else low_ref[...]
  delta = delta_ref[...]
  unbiased_ds = unbiased_roundings(spec, do.dtype)[1]

  def body(kv_block, dq, masked):
    k, logits = _key_tile(spec, qt, k_ref, key_seg_ref, kv_block, block_kv, padded, fast_cap,
                          masked)
    p = probabilities(logits, shift, low)
    dp = dot(do, _value_tile(v_ref, kv_block, block_kv), trans_b=True)
    ds = logits_grad(spec, p, dp, delta, logits, qt.temp, fast_cap)
    bits = (dither_bits(*position_grid(ds.shape, qt.start, kv_block * block_kv), 1)
            if unbiased_ds else None)
    ds16, exponent = matmul_operand(ds, k.dtype, axis=1, bits=bits)
    term = gradient_product(ds16, k)
    return dq + scaled_back(term, exponent)

  tiles = kv_tiles(spec, qt.start, block_q, block_kv, padded,
                   *_segment_span(span_ref, qt.start, block_q), delta=qt.offset)
  dq = tile_loop(tiles, body, jnp.zeros(qt.q.shape, jnp.float32))
  dq_ref[...] = dq.astype(dq_ref.dtype)


def dkv_kernel(q_ref, k_ref, v_ref, seg_ref, span_ref, temp_ref, kseg_ref, offset_ref, do_ref,
               shift_ref, low_ref, delta_ref, dk_ref, dv_ref, *, spec: StaticSpec,
               block_q: int, block_kv: int, padded: bool, fast_cap: bool,
               per_head_totals: bool):
  """dk, dv of one key tile of one kv head, summed over its query-head group.

  q/do refs hold the G query heads of the group ([T, G, D]); shift/low/
  delta/temp refs [G, T]. The group sum happens in registers, no repeated K/V.

  How the G heads' terms meet in the float32 accumulators decides the error
  of the group sum (docs/DEFECTS.md, G1). With the heads in the outer loop, the
  many small terms of a head's long rows were added to a total already holding
  other heads' large terms, and dk/dv lost precision in proportion to G.
  ``per_head_totals`` (float32 outputs) sums each head from zero, as one head
  of MHA would, and adds the G totals: the group costs G roundings. Otherwise
  the query tiles are the outer loop and the heads the inner one: each tile's
  terms of all heads are added together, in the order of a single head, with
  no second pair of accumulators (16-bit outputs, whose rounding hides the
  rest, keep their registers).
  """
  k_start = pl.program_id(0) * block_kv
  k = k_ref[...]
  v = v_ref[...]
  k_pos = positions(k_start, block_kv)
  k_seg = _segment_tile(seg_ref if kseg_ref is None else kseg_ref, k_start, block_kv)
  offset = _offset(offset_ref)
  tiles = q_tiles(spec, k_start, block_q, block_kv, padded,
                  *_segment_span(span_ref, k_start, block_kv), delta=offset)
  unbiased_p, unbiased_ds = unbiased_roundings(spec, k.dtype)

  def add_head_tile(g, q_block, carry, masked):
    """Adds head g's terms of query tile q_block to (dk, dv)."""
    dk, dv = carry
    q_start = q_block * block_q
    rows = pl.ds(q_start, block_q)
    q = q_ref[rows, g, :]
    do = do_ref[rows, g, :]
    shift = shift_ref[g, rows]
    low = None if low_ref is None else low_ref[g, rows]
    delta = delta_ref[g, rows]
    temp = None if temp_ref is None else temp_ref[g, rows]
    mask = None
    if masked:
      by_segment = masked is TileMask.FULL
      mask = visible_mask(spec, positions(q_start, block_q), k_pos,
                          _segment_tile(seg_ref, q_start, block_q) if by_segment else None,
                          k_seg if by_segment else None, padded=padded, delta=offset)
    logits = tile_logits(spec, q, k, temp, mask, fast_cap)
    p = probabilities(logits, shift, low)
    grid = position_grid(p.shape, q_start, k_start) if unbiased_p or unbiased_ds else None
    dv = dv + gradient_product(
        to_operand(p, do.dtype, dither_bits(*grid, 0) if unbiased_p else None), do, trans_a=True)
    dp = dot(do, v, trans_b=True)
    ds = logits_grad(spec, p, dp, delta, logits, temp, fast_cap)
    ds16, exponent = matmul_operand(ds, q.dtype, axis=0,
                                    bits=dither_bits(*grid, 1) if unbiased_ds else None)
    term = gradient_product(ds16, q, trans_a=True)
    dk = dk + scaled_back(term, exponent)
    return dk, dv

  zeros = (jnp.zeros(k.shape, jnp.float32),) * 2
  if per_head_totals:
    def head(g, total):
      dk, dv = tile_loop(tiles, lambda q_block, carry, masked: add_head_tile(
          g, q_block, carry, masked), zeros)
      return total[0] + dk, total[1] + dv

    dk, dv = lax.fori_loop(0, spec.group_size, head, zeros)
  else:
    def tile(q_block, carry, masked):
      return lax.fori_loop(0, spec.group_size, lambda g, carry: add_head_tile(
          g, q_block, carry, masked), carry)

    dk, dv = tile_loop(tiles, tile, zeros)
  dk_ref[...] = dk.astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)
