"""Segment spans and runs: where each position's packed document begins and
ends, so that the kernels visit only the tiles of a tile's own documents, and
run unmasked the tiles that lie inside one document."""

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
  """Per position, [first, last + 1) of the positions holding its id, for ids
  in any order (a sort groups them)."""
  b, t = seg.shape
  order = jnp.argsort(seg, axis=1, stable=True)
  ordered = jnp.take_along_axis(seg, order, axis=1)
  new_segment = jnp.concatenate([jnp.ones((b, 1), bool), ordered[:, 1:] != ordered[:, :-1]],
                                axis=1)
  group = jnp.cumsum(new_segment, axis=1, dtype=jnp.int32) - 1
  first = jax.vmap(lambda o, g: jax.ops.segment_min(o, g, num_segments=t))(order, group)
  last = jax.vmap(lambda o, g: jax.ops.segment_max(o, g, num_segments=t))(order, group)
  inverse = jnp.argsort(order, axis=1)
  at_position = lambda per_group: jnp.take_along_axis(
      jnp.take_along_axis(per_group, group, axis=1), inverse, axis=1).astype(jnp.int32)
  return at_position(first), at_position(last) + 1


def segment_spans(seg, seq_pad: int):
  """[B, 2, T_pad] int32: for each position, the first position of its segment
  and one past the last (padding: an empty span), so that the kernels visit
  only tiles holding some same-segment pair. Ids need not be sorted or
  contiguous: a segment spread out gets its whole extent. When every row's ids
  are monotone (packed documents numbered in order), each id is one run and
  the runs are its extents, found without the sort."""
  change = seg[:, 1:] - seg[:, :-1]
  monotone = jnp.all(jnp.all(change >= 0, axis=1) | jnp.all(change <= 0, axis=1))
  lo, hi = jax.lax.cond(monotone, _runs, _extents, seg)
  return _pad_empty(lo, hi, seq_pad)


def segment_runs(seg, seq_pad: int):
  """[B, 2, T_pad] int32: for each position, [lo, hi) of the contiguous run of
  positions around it holding its segment id (padding: an empty run). A tile
  whose positions all lie in one run, against a tile inside that run, holds
  only same-segment pairs: the kernels run such tile pairs without a segment
  mask (tile_math.kv_tiles' ``uniform``). Runs, not segment extents: an id
  spread out over the sequence has other ids between its runs."""
  return _pad_empty(*_runs(seg), seq_pad)
