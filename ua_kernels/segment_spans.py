"""Segment spans: where each position's packed document begins and ends, so
that the kernels visit only the tiles of a tile's own documents."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def segment_spans(seg, seq_pad: int):
  """[B, 2, T_pad] int32: for each position, the first position of its segment
  and one past the last (padding: an empty span), so that the kernels visit
  only tiles holding some same-segment pair (kernels._segment_span). Ids need
  not be sorted or contiguous: a segment spread out gets its whole extent."""
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
  pad = ((0, 0), (0, seq_pad - t))
  return jnp.stack([jnp.pad(at_position(first), pad, constant_values=seq_pad),
                    jnp.pad(at_position(last) + 1, pad, constant_values=0)], axis=1)
