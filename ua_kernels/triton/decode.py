"""The Pallas-Triton forward for few queries against many keys (decode): the
keys cut into ranges, one program each (split-K, KernelConfig.kv_splits),
and a GQA group's query heads packed as the rows of one tile
(KernelConfig.pack_gqa), so that one program reads its kv head's keys once
for the whole group. Each program leaves a float32 partial softmax;
SoftmaxState's combine_splits merges them, the sinks with them. The table
(triton.tuned) takes this path for decode only; docs/BENCHMARKS.md, "Decode"."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ua_reference.contract import StaticSpec

from ..kernel_config import KernelConfig
from ..padding import pad as _pad
from ..softmax_state import combine_splits
from ..tile_math import LOG2E, exp2_scale
from . import kernels
from .launch import (KeyBlock, _compiler_params, _key_block_inputs, _layout, _pallas_call,
                     _segment_specs, clipped_block, keeps_low)


def splits(spec: StaticSpec, config: KernelConfig) -> int:
  """config.kv_splits, fewer where the keys' tiles run out: every split
  holds ceil(tiles / kv_splits) tiles, the last one the rest."""
  tiles = -(-spec.kv_seq_len // _layout(spec, config).blocks["block_kv"])
  per_split = -(-tiles // config.kv_splits)
  return -(-tiles // per_split)


def applies(spec: StaticSpec, config: KernelConfig) -> bool:
  """Whether a call's forward runs here: split keys or packed heads."""
  return splits(spec, config) > 1 or (config.pack_gqa and spec.group_size > 1)


def _packed(x, group: int):
  """[B, T, Hq, ...] -> [B, T * G, Hkv, ...], row t * G + g holding head h * G + g."""
  b, t, hq = x.shape[:3]
  x = x.reshape(b, t, hq // group, group, *x.shape[3:])
  return jnp.swapaxes(x, 2, 3).reshape(b, t * group, hq // group, *x.shape[4:])


def _unpacked_rows(x, t: int, group: int):
  """[..., Hkv, T * G] (row statistics) -> [..., Hq, T]."""
  *lead, hkv, _ = x.shape
  x = x[..., :t * group].reshape(*lead, hkv, t, group)
  return jnp.swapaxes(x, -1, -2).reshape(*lead, hkv * group, t)


def forward(spec: StaticSpec, config: KernelConfig, q, k, v, seg, temp, keys, *,
            fast_cap: bool, sinks=None):
  """(out, shift, low) as triton.launch.forward returns them. ``keys`` is the
  key block of ua_kernels.attention (its own ids or None, the offset)."""
  b, t, hq, d = q.shape
  group = spec.group_size if config.pack_gqa else 1
  n_splits = splits(spec, config)
  kseg = seg if keys is None or keys.segment_ids is None else keys.segment_ids
  if group > 1:
    q = _packed(q, group)
    seg = None if seg is None else jnp.repeat(seg, group, axis=1)
    temp = None if temp is None else _packed(temp[..., None], group)[..., 0]
  rows = t * group
  layout = _layout(spec, config)
  bq = clipped_block(config.block_q, rows)
  q_pad = -(-rows // bq) * bq
  head_dim, kv_pad = layout.head_dim, layout.kv_pad
  q = _pad(q, {1: q_pad, 3: head_dim})
  k, v = (_pad(x, {1: kv_pad, 3: head_dim}) for x in (k, v))
  seg = None if seg is None else _pad(seg, {1: q_pad})
  if temp is not None:
    temp = _pad(jnp.transpose(temp, (0, 2, 1)), {2: q_pad})
  # The keys' ids apart from the (packed) queries' ones; keys of the queries' own
  # sequence are a key block at offset 0.
  offset = jnp.int32(0) if keys is None else keys.offset
  key_inputs, key_specs = _key_block_inputs(KeyBlock(kseg, offset), kv_pad)
  out, shift, low = _partials(spec, config, (q, k, v, seg, temp), key_inputs, key_specs,
                              (bq, q_pad, kv_pad, head_dim, layout.padded or q_pad != rows),
                              n_splits, group, fast_cap)
  heads = q.shape[2]
  if group > 1:
    out = out[:, :, :rows].reshape(n_splits, b, t, group, heads, head_dim)
    out = jnp.swapaxes(out, 3, 4).reshape(n_splits, b, t, hq, head_dim)
    shift, low = (_unpacked_rows(x, t, group) for x in (shift, low))
  else:
    out, shift, low = out[:, :, :t], shift[..., :t], low[..., :t]
  scale = exp2_scale(spec, temp is not None)
  sink = None if sinks is None else sinks.astype(jnp.float32) * (LOG2E / scale)
  out, shift, low = combine_splits(out, shift, low, scale, keeps_low(q.dtype), sink)
  return out[..., :d].astype(q.dtype), shift, low


def _partials(spec, config, inputs, key_inputs, key_specs, shape, n_splits, group, fast_cap):
  """The pallas_call: program (i, b, h) runs query tile i // n_splits of head
  h (a kv head when packed) over key split i % n_splits; float32 out
  [S, B, rows, H, D] and row statistics [S, B, H, rows], finalize(with_low)'s."""
  q, k, v, seg, temp = inputs
  bq, q_pad, kv_pad, head_dim, padded = shape
  b, _, heads, _ = q.shape
  kv_head = (lambda h: h) if group > 1 else (lambda h: h // spec.group_size)
  kernel = functools.partial(kernels.forward_kernel, spec=spec, block_q=bq,
                             block_kv=_layout(spec, config).blocks["block_kv"], padded=padded,
                             fast_cap=fast_cap, splits=n_splits, rows_per_position=group)
  tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, bi, h: (bi, i // n_splits, h, 0))
  whole_kv = pl.BlockSpec((None, kv_pad, None, head_dim),
                          lambda i, bi, h: (bi, 0, kv_head(h), 0))
  row = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i // n_splits))
  part = pl.BlockSpec((None, None, bq, None, head_dim),
                      lambda i, bi, h: (i % n_splits, bi, i // n_splits, h, 0))
  part_row = pl.BlockSpec((None, None, None, bq),
                          lambda i, bi, h: (i % n_splits, bi, h, i // n_splits))
  rows = jax.ShapeDtypeStruct((n_splits, b, heads, q_pad), jnp.float32)
  return _pallas_call(
      config, (q, k, v, seg, None, temp, *key_inputs, None), kernel,
      grid=(q_pad // bq * n_splits, b, heads),
      in_specs=[tile, whole_kv, whole_kv, *_segment_specs(seg, None, q_pad),
                None if temp is None else row, *key_specs, None],
      out_specs=[part, part_row, part_row],
      out_shape=[jax.ShapeDtypeStruct((n_splits, *q.shape), jnp.float32), rows, rows],
      compiler_params=_compiler_params(config),
      name="ua_forward_decode",
  )
