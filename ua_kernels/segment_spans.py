"""Segment spans and runs: where each position's packed document begins and
ends, so that the kernels visit only the tiles of a tile's own documents, and
read no segment ids for the tiles that lie inside one document (tile_math.TileMask)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _pad_empty(lo, hi, seq_pad: int):
  """[B, 2, T_pad] of per-position [lo, hi), padding positions given an empty
  one ([T_pad, 0))."""
  pad = ((0, 0), (0, seq_pad - lo.shape[1]))
  return jnp.stack([jnp.pad(lo, pad, constant_values=seq_pad),
                    jnp.pad(hi, pad, constant_values=0)], axis=1).astype(jnp.int32)


def _runs(seg):
  """Per position, [lo, hi) of the contiguous run around it of its id."""
  b, t = seg.shape
  index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  change = seg[:, 1:] != seg[:, :-1]
  starts = jnp.concatenate([jnp.ones((b, 1), bool), change], axis=1)
  ends = jnp.concatenate([change, jnp.ones((b, 1), bool)], axis=1)
  lo = jax.lax.cummax(jnp.where(starts, index, 0), axis=1)
  hi = jax.lax.cummin(jnp.where(ends, index + 1, t), axis=1, reverse=True)
  return lo, hi


def _extents(seg):
  """Per position, [first, last + 1) of the positions holding its id, by a
  scatter into a table indexed by id, for rows whose ids all lie in [0, T)
  (document numbers, the usual packing); a row with other ids gets [0, T), a
  span that skips nothing (its tiles are visited and masked). No sort: a sort
  of the ids costs more than the kernels save on short sequences."""
  b, t = seg.shape
  index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  in_table = jnp.all((seg >= 0) & (seg < t), axis=1, keepdims=True)
  ids = jnp.where(in_table, seg, 0)
  # One scatter for both ends: the minimum of (i, -i) per id is (first, -last).
  both = jnp.stack([index, -index], axis=-1)
  ends = jax.vmap(lambda x, g: jax.ops.segment_min(x, g, num_segments=t))(both, ids)
  lo = jnp.take_along_axis(ends[..., 0], ids, axis=1)
  hi = 1 - jnp.take_along_axis(ends[..., 1], ids, axis=1)
  return jnp.where(in_table, lo, 0), jnp.where(in_table, hi, t)


def _monotone(seg):
  """[B, 1] bool: rows whose ids never decrease or never increase (documents
  numbered in order), whose runs are their segments' extents. Compared, not
  subtracted: a difference of int32 ids can wrap around."""
  before, after = seg[:, :-1], seg[:, 1:]
  return (jnp.all(after >= before, axis=1) | jnp.all(after <= before, axis=1))[:, None]


def _spans(seg, runs):
  """Per position, [lo, hi) of its segment's extent (unpadded; see segment_spans),
  from the row's ``runs`` (_runs) where its ids are monotone."""
  monotone = _monotone(seg)
  (run_lo, run_hi), (ext_lo, ext_hi) = runs, _extents(seg)
  return jnp.where(monotone, run_lo, ext_lo), jnp.where(monotone, run_hi, ext_hi)


def segment_spans(seg, seq_pad: int):
  """[B, 2, T_pad] int32: for each position, the first position of its segment
  and one past the last (padding: an empty span), so that the kernels visit
  only tiles holding some same-segment pair. Ids need not be sorted or
  contiguous: a segment spread out gets its whole extent. A row of monotone
  ids (documents in order) takes its runs, which are then its extents; other
  rows the table of _extents. Both are computed, without a sort or a
  conditional (one would stop the host for its predicate)."""
  return _pad_empty(*_spans(seg, _runs(seg)), seq_pad)


def segment_runs(seg, seq_pad: int):
  """[B, 2, T_pad] int32: for each position, [lo, hi) of the contiguous run of
  positions around it holding its segment id (padding: an empty run). A tile
  whose positions all lie in one run, against a tile inside that run, holds
  only same-segment pairs: the kernels run such tile pairs without a segment
  mask (tile_math.kv_tiles' ``uniform``). Runs, not segment extents: an id
  spread out over the sequence has other ids between its runs."""
  return _pad_empty(*_runs(seg), seq_pad)


def segment_ranges(seg, seq_pad: int):
  """[B, 4, T_pad] int32: segment_spans' two rows, then segment_runs' two, what
  the kernels take for segment ids; the runs are computed once for both."""
  runs = _runs(seg)
  return jnp.concatenate([_pad_empty(*_spans(seg, runs), seq_pad), _pad_empty(*runs, seq_pad)],
                         axis=1)


def tile_ranges(seg, seq_pad: int, block: int):
  """[B, T_pad / block, 4] int32, per tile of ``block`` positions: the hull of
  its positions' spans (segment_spans) and the intersection of their runs
  (segment_runs; empty, [T_pad, 0), where the tile holds two runs or
  padding), the same values as reducing segment_ranges over each tile, but
  from per-tile reductions and scans over the T_pad / block tiles only: the
  per-position scans of segment_runs are as long as the row.

  A tile's first position has run start ``run_lo`` (the last run start at or
  before it) and its last one run end ``run_hi`` (the first start after the
  tile, or T); for in-order ids these bound the hull of the tile's segments,
  and for a tile with no start after its first position they are its run."""
  b, t = seg.shape
  n = seq_pad // block
  index = jnp.arange(seq_pad, dtype=jnp.int32)
  valid = index < t
  padded = jnp.pad(seg, ((0, 0), (0, seq_pad - t)))
  start = jnp.concatenate([jnp.ones((b, 1), bool), padded[:, 1:] != padded[:, :-1]],
                          axis=1) & valid
  per_tile = lambda x: x.reshape(b, n, block)
  last_in = per_tile(jnp.where(start, index, -1)).max(axis=-1)
  first_in = per_tile(jnp.where(start, index, seq_pad)).min(axis=-1)
  edge = lambda value: jnp.full((b, 1), value, jnp.int32)
  last_before = jnp.concatenate([edge(-1), jax.lax.cummax(last_in, axis=1)[:, :-1]], axis=1)
  first_after = jnp.concatenate(
      [jax.lax.cummin(first_in, axis=1, reverse=True)[:, 1:], edge(seq_pad)], axis=1)
  tile_start = jnp.arange(n, dtype=jnp.int32) * block
  starts = per_tile(start)
  run_lo = jnp.where(starts[:, :, 0], tile_start, last_before)
  run_hi = jnp.minimum(first_after, t)
  any_valid = tile_start < t
  all_valid = tile_start + block <= t
  uniform = all_valid & ~starts[:, :, 1:].any(axis=-1)
  empty_lo, empty_hi = jnp.int32(seq_pad), jnp.int32(0)

  monotone = _monotone(seg)
  ext_lo, ext_hi = _extents(seg)
  ext = _pad_empty(ext_lo, ext_hi, seq_pad).reshape(b, 2, n, block)
  span_lo = jnp.where(monotone, run_lo, ext[:, 0].min(axis=-1))
  span_hi = jnp.where(monotone, run_hi, ext[:, 1].max(axis=-1))
  return jnp.stack([jnp.where(any_valid, span_lo, empty_lo),
                    jnp.where(any_valid, span_hi, empty_hi),
                    jnp.where(uniform, run_lo, empty_lo),
                    jnp.where(uniform, run_hi, empty_hi)], axis=-1).astype(jnp.int32)
