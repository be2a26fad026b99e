"""The Pallas-Triton backend's launch code: the layout its kernels take (padded
head dim and length, tiles clipped to the length), the three pallas_calls
(forward, dq, dk/dv; their kernels in ua_kernels.triton.kernels) and their
BlockSpecs. It runs every dtype and head dim, compiled on any GPU or in the
Pallas interpreter, and the key blocks of context_parallel (KeyBlock)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ua_reference.contract import StaticSpec

from .. import fast_math
from ..kernel_config import KernelConfig
from ..padding import pad as _pad
from ..segment_spans import segment_ranges
from . import kernels

def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def clipped_block(block: int, length: int) -> int:
  """A tile of ``block`` rows clipped to ``length`` rows: the next power of two
  of at least 16 (Triton's dot needs 16-row tiles)."""
  return min(block, max(16, _next_pow2(length)))


class _Layout(NamedTuple):
  """Padded head dim, the queries' and the keys' padded lengths, and the
  blocks clipped to their lengths."""

  head_dim: int
  q_pad: int
  kv_pad: int
  blocks: dict
  t_q: int
  t_kv: int

  @property
  def padded(self) -> bool:
    return self.q_pad != self.t_q or self.kv_pad != self.t_kv


_Q_BLOCKS = ("block_q", "block_q_dq", "block_q_dkv")
_KV_BLOCKS = ("block_kv", "block_kv_dq", "block_kv_dkv")


def _layout(spec: StaticSpec, config: KernelConfig) -> _Layout:
  """Equal lengths pad both sides to one multiple of the largest block; keys
  of another length pad each side to its own blocks, clipped to its length."""
  head_dim = max(16, _next_pow2(spec.head_dim))
  t_q, t_kv = spec.seq_len, spec.kv_seq_len
  if t_q == t_kv:
    blocks = {name: clipped_block(getattr(config, name), t_q) for name in _Q_BLOCKS + _KV_BLOCKS}
    biggest = max(blocks.values())
    seq_pad = -(-t_q // biggest) * biggest
    return _Layout(head_dim, seq_pad, seq_pad, blocks, t_q, t_kv)
  blocks = {}
  for names, t in ((_Q_BLOCKS, t_q), (_KV_BLOCKS, t_kv)):
    blocks.update({name: clipped_block(getattr(config, name), t) for name in names})
  step = lambda names: max(blocks[n] for n in names)
  return _Layout(head_dim, -(-t_q // step(_Q_BLOCKS)) * step(_Q_BLOCKS),
                 -(-t_kv // step(_KV_BLOCKS)) * step(_KV_BLOCKS), blocks, t_q, t_kv)


def _per_head_totals(spec: StaticSpec, dtype) -> bool:
  """Whether the dk/dv kernel sums each query head of a GQA group from zero
  before adding it to the group's total (kernels.dkv_kernel). float32 outputs
  need it: with one shared accumulator a long group's sum loses precision in
  proportion to its size (docs/DEFECTS.md, G1). 16-bit outputs round away what
  remains and keep the registers of a second pair of accumulators."""
  return spec.group_size > 1 and jnp.dtype(dtype) == jnp.float32


def interpreted(config: KernelConfig) -> bool:
  if config.interpret is not None:
    return config.interpret
  return jax.default_backend() != "gpu"


def _compiler_params(config: KernelConfig, backward: bool = False):
  warps = config.num_warps_bwd if backward else config.num_warps
  stages = config.num_stages_bwd if backward else config.num_stages
  return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _pallas_call(config: KernelConfig, inputs, kernel, **kwargs):
  """pallas_call, interpreted or compiled as ``config`` says, with the kernel
  traced for the matching fast-math mode (ua_kernels.fast_math)."""
  interpret = interpreted(config)
  with fast_math.native(None if interpret else "triton"):
    return pl.pallas_call(kernel, interpret=interpret, **kwargs)(*inputs)


def _prepare(spec, config, q, k, v, seg, temp, kseg=None):
  """Pads to the kernel layout; segment ids gain their spans and runs
  ([B, 4, T_pad], segment_spans.segment_ranges), unless the keys have their
  own (``kseg``: the spans would be the queries'); temperature becomes
  [B, Hq, T_pad]."""
  layout = _layout(spec, config)
  q = _pad(q, {1: layout.q_pad, 3: layout.head_dim})
  k, v = (_pad(x, {1: layout.kv_pad, 3: layout.head_dim}) for x in (k, v))
  spans = None
  if seg is not None:
    spans = None if kseg is not None else segment_ranges(seg, layout.q_pad)
    seg = _pad(seg, {1: layout.q_pad})
  if temp is not None:
    temp = _pad(jnp.transpose(temp, (0, 2, 1)), {2: layout.q_pad})
  return q, k, v, seg, spans, temp, layout


def _segment_specs(seg, spans, seq_pad: int):
  """BlockSpecs of the whole row of segment ids and of their spans, for any of
  the three grids (tile, batch, head); None for each that is absent."""
  return (None if seg is None else pl.BlockSpec((None, seq_pad), lambda i, bi, h: (bi, 0)),
          None if spans is None else pl.BlockSpec((None, 4, seq_pad),
                                                  lambda i, bi, h: (bi, 0, 0)))


class KeyBlock(NamedTuple):
  """Keys from elsewhere in the sequence (a shard of context_parallel): their
  own segment ids [B, T] (or None) and ``offset``, an int32 scalar, how far
  the queries' positions lie after the keys' (kernels.forward_kernel)."""

  segment_ids: jax.Array | None
  offset: jax.Array


# The offset travels as a [1, 16] int32 row (Triton loads no scalars; kernels._offset).
_OFFSET_SPEC = pl.BlockSpec((1, 16), lambda i, bi, h: (0, 0))


def _key_block_inputs(keys: "KeyBlock | None", seq_pad: int):
  """(kseg, offset row) padded for the kernels, and their BlockSpecs."""
  if keys is None:
    return (None, None), (None, None)
  kseg = None if keys.segment_ids is None else _pad(keys.segment_ids, {1: seq_pad})
  offset = jnp.broadcast_to(jnp.asarray(keys.offset, jnp.int32), (1, 16))
  kseg_spec, _ = _segment_specs(kseg, None, seq_pad)  # the queries' ids' spec
  return (kseg, offset), (kseg_spec, _OFFSET_SPEC)


def _query_program_specs(spec: StaticSpec, bq: int, head_dim: int, kv_pad: int):
  """BlockSpecs of a program that owns one query tile (forward, dq) on the grid
  (query tile i, batch, query head): its [bq, D] tile, the whole K/V of its kv
  head, and its [bq] row vector."""
  group = spec.group_size
  tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, bi, h: (bi, i, h, 0))
  whole_kv = pl.BlockSpec((None, kv_pad, None, head_dim),
                          lambda i, bi, h: (bi, 0, h // group, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i))
  return tile, whole_kv, row


def keeps_low(dtype) -> bool:
  """Whether the forward's row statistics keep their low part, log2 of the row
  sum apart from the row max (SoftmaxState.finalize). float32 gradients need
  it where the logits are large (docs/DEFECTS.md, D32); 16-bit ones round far
  more than what one float32 loses, and the Mosaic kernels, 16-bit only, do
  without."""
  return jnp.dtype(dtype) == jnp.float32


def _sink_rows(sinks):
  """The sinks as [Hq, 16] float32 rows of one value (Triton loads no scalars),
  and their BlockSpec: the program's head's row."""
  if sinks is None:
    return None, None
  rows = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None], (sinks.shape[0], 16))
  return rows, pl.BlockSpec((None, 16), lambda i, bi, h: (h, 0))


def forward(spec: StaticSpec, config: KernelConfig, q, k, v, seg, temp,
            keys: KeyBlock | None, *, fast_cap: bool, sinks=None):
  """(out, shift, low): the rows' statistics of SoftmaxState.finalize, low
  None unless keeps_low. ``config`` is effective (effective_config)."""
  keep_low = keeps_low(q.dtype)
  b, t, hq, d = q.shape
  q, k, v, seg, spans, temp, layout = _prepare(
      spec, config, q, k, v, seg, temp, None if keys is None else keys.segment_ids)
  key_inputs, key_specs = _key_block_inputs(keys, layout.kv_pad)
  bq, bkv = layout.blocks["block_q"], layout.blocks["block_kv"]
  kernel = functools.partial(kernels.forward_kernel, spec=spec, block_q=bq,
                             block_kv=bkv, padded=layout.padded,
                             fast_cap=fast_cap)
  tile, whole_kv, row = _query_program_specs(spec, bq, layout.head_dim, layout.kv_pad)
  rows = jax.ShapeDtypeStruct((b, hq, layout.q_pad), jnp.float32)
  sink_rows, sink_spec = _sink_rows(sinks)
  out, shift, *low = _pallas_call(
      config, (q, k, v, seg, spans, temp, *key_inputs, sink_rows), kernel,
      grid=(layout.q_pad // bq, b, hq),
      in_specs=[tile, whole_kv, whole_kv, *_segment_specs(seg, spans, layout.q_pad),
                None if temp is None else row, *key_specs, sink_spec],
      out_specs=[tile, row] + [row] * keep_low,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), rows] + [rows] * keep_low,
      compiler_params=_compiler_params(config),
      name="ua_forward",
  )
  return out[:, :t, :, :d], shift[:, :, :t], low[0][:, :, :t] if low else None


def backward(spec: StaticSpec, config: KernelConfig, q, k, v, seg, temp, shift, low, delta,
             dout, keys: KeyBlock | None, *, fast_cap: bool):
  """(dq, dk, dv); ``shift`` and ``low`` as forward returns them, ``delta`` as
  ua_kernels.attention computes it; ``config`` is effective (effective_config)."""
  b, t, hq, d = q.shape
  t_kv = k.shape[1]
  hkv, group = spec.num_kv_heads, spec.group_size
  q, k, v, seg, spans, temp, layout = _prepare(
      spec, config, q, k, v, seg, temp, None if keys is None else keys.segment_ids)
  head_dim, q_pad, kv_pad, blocks = layout.head_dim, layout.q_pad, layout.kv_pad, layout.blocks
  key_inputs, key_specs = _key_block_inputs(keys, kv_pad)
  dout = _pad(dout, {1: q_pad, 3: head_dim})
  shift = _pad(shift, {2: q_pad})
  if low is not None:
    low = _pad(low, {2: q_pad})
  delta = _pad(delta, {2: q_pad})
  padded = layout.padded
  segment_specs = _segment_specs(seg, spans, q_pad)
  params = dict(compiler_params=_compiler_params(config, backward=True))
  inputs = (q, k, v, seg, spans, temp, *key_inputs, dout, shift, low, delta)
  has_low = low is not None

  # dq: one program per (query tile, batch, query head).
  bq, bkv = blocks["block_q_dq"], blocks["block_kv_dq"]
  tile, whole_kv, row = _query_program_specs(spec, bq, head_dim, kv_pad)
  dq = _pallas_call(
      config, inputs, functools.partial(kernels.dq_kernel, spec=spec, block_q=bq, block_kv=bkv,
                        padded=padded, fast_cap=fast_cap),
      grid=(q_pad // bq, b, hq),
      in_specs=[tile, whole_kv, whole_kv, *segment_specs,
                None if temp is None else row, *key_specs, tile, row,
                row if has_low else None, row],
      out_specs=tile,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name="ua_backward_dq", **params,
  )

  # dk/dv: one program per (key tile, batch, kv head); loops over the group.
  bq, bkv = blocks["block_q_dkv"], blocks["block_kv_dkv"]
  kv_tile = pl.BlockSpec((None, bkv, None, head_dim), lambda j, bi, h: (bi, j, h, 0))
  group_q = pl.BlockSpec((None, q_pad, group, head_dim), lambda j, bi, h: (bi, 0, h, 0))
  group_rows = pl.BlockSpec((None, group, q_pad), lambda j, bi, h: (bi, h, 0))
  dk, dv = _pallas_call(
      config, inputs, functools.partial(kernels.dkv_kernel, spec=spec, block_q=bq, block_kv=bkv,
                        padded=padded, fast_cap=fast_cap,
                        per_head_totals=_per_head_totals(spec, q.dtype)),
      grid=(kv_pad // bkv, b, hkv),
      in_specs=[group_q, kv_tile, kv_tile, *segment_specs,
                None if temp is None else group_rows, *key_specs, group_q, group_rows,
                group_rows if has_low else None, group_rows],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
      name="ua_backward_dkv", **params,
  )
  return dq[:, :t, :, :d], dk[:, :t_kv, :, :d], dv[:, :t_kv, :, :d]
