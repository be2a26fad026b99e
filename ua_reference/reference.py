"""The oracle: docs/SEMANTICS.md written as plain jnp, to be read.

Computes in float32 for 16/32-bit inputs and float64 for float64 inputs, and
takes every gradient from autodiff. The only non-autodiff piece is the z-loss:
the contract says its gradient is added "as if the caller had added
1/2 * w * sum(lse^2) to the loss", a term no output carries, so a one-line
custom_vjp identity on lse injects ``w * lse`` into lse's cotangent.

Rows are independent, so long sequences are computed in blocks of query rows
(:data:`MAX_LOGITS` bounds the [B, Hq, rows, T] logits of one block), each
rematerialised in the backward pass: the oracle's memory stays bounded at
T = 16k with many heads, and short sequences are one block, as written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .contract import StaticSpec, validate_call, with_z_loss_gradient

# Largest number of logits [B, Hq, rows, T] computed at once (2^25: 256 MiB in float64).
# The float64 oracle's VJP at B=1, T=16384, 16 heads, D=128 then needs 3.75 GiB of
# temporaries (XLA's memory analysis; 5.75 GiB at 2^26, which ran out of memory in a
# 16-worker campaign's share of one H200, docs/VERIFICATION.md).
MAX_LOGITS = 1 << 25


def _visible(i, j, seg_i, seg_j, causal, window_len):
  """Boolean [B or 1, rows, Tk]: key position j visible to the query at key
  position i (its own index plus q_offset)."""
  i, j = i[:, None], j[None, :]
  mask = jnp.ones((1,) + jnp.broadcast_shapes(i.shape, j.shape), bool)
  if seg_i is not None:
    mask = seg_i[:, :, None] == seg_j[:, None, :]
  if causal:
    mask = mask & (j <= i)
  if window_len > 0:
    mask = mask & (j > i - window_len)
  return mask


def visible_keys(seq_len, segment_ids, causal, window_len, queries=None, keys=None, *,
                 kv_seq_len=None, kv_segment_ids=None, q_offset=0):
  """Boolean [B or 1, Q, K] mask: key j is visible to query i, for the query
  and key indices ``queries`` and ``keys`` (default all Tq and all Tk; slices
  keep the mask of a long sequence small). ``segment_ids`` are the queries',
  ``kv_segment_ids`` the keys' (default the queries'), query i sits at key
  position i + ``q_offset``."""
  q_idx = jnp.arange(seq_len) if queries is None else jnp.asarray(queries)
  k_idx = jnp.arange(seq_len if kv_seq_len is None else kv_seq_len) if keys is None \
      else jnp.asarray(keys)
  seg = None if segment_ids is None else jnp.asarray(segment_ids)
  kv_seg = seg if kv_segment_ids is None else jnp.asarray(kv_segment_ids)
  return _visible(q_idx + q_offset, k_idx, None if seg is None else seg[:, q_idx],
                  None if seg is None else kv_seg[:, k_idx], causal, window_len)


def _query_rows(spec: StaticSpec, q, k, v, pos, seg_q, seg_k, temp, sinks):
  """out [B, rows, Hq, D] and lse [B, Hq, rows] of the query rows ``q`` at key
  positions ``pos``, against every key; k and v already repeated to Hq heads."""
  # Order of the contract: scale, cap, temperature, then masking.
  scaled = spec.sm_scale * jnp.einsum(
      "bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST)
  logits = spec.cap.forward(scaled, *spec.cap_params)
  if temp is not None:
    logits = logits * jnp.transpose(temp, (0, 2, 1))[..., None]
  mask = _visible(pos, jnp.arange(spec.kv_seq_len), seg_q, seg_k, spec.causal,
                  spec.window_len)
  mask = jnp.broadcast_to(mask[:, None], logits.shape)

  # A sink is one more logit of the row's softmax, of value zero.
  sink = None if sinks is None else sinks[None, :, None, None]
  # Rows with no visible key (and no sink): out 0, lse -inf, zero gradients (double where).
  row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  if sink is not None:
    row_max = jnp.maximum(row_max, sink)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  exps = jnp.where(mask, jnp.exp(jnp.where(mask, logits, row_max) - row_max), 0.0)
  total = jnp.sum(exps, axis=-1)
  if sink is not None:
    total = total + jnp.exp(sink - row_max)[..., 0]
  has_mass = total > 0
  lse = jnp.where(has_mass, jnp.log(jnp.where(has_mass, total, 1.0)) + row_max[..., 0],
                  -jnp.inf)
  if spec.z_loss_weight:
    lse = with_z_loss_gradient(lse, spec.z_loss_weight)
  safe_lse = jnp.where(has_mass, lse, 0.0)
  probs = jnp.where(mask, jnp.exp(jnp.where(mask, logits - safe_lse[..., None], 0.0)), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=jax.lax.Precision.HIGHEST)
  return out, lse


def rows_per_block(spec: StaticSpec) -> int:
  """Query rows computed at once, so that a block's logits stay within MAX_LOGITS."""
  per_row = spec.batch * spec.num_q_heads * spec.kv_seq_len
  return max(1, min(spec.seq_len, MAX_LOGITS // per_row))


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, sinks=None,
              causal=False, window_len=0, cap_method="none", cap_params=(), temperature=None,
              sm_scale=None, z_loss_weight=0.0, return_lse=False, deterministic=True,
              config=None):
  """Reference unified attention; ``deterministic`` and ``config`` (the kernels'
  choices of how to compute it) are accepted and ignored."""
  del deterministic, config
  call = validate_call(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      sinks=sinks, causal=causal, window_len=window_len, cap_method=cap_method,
      cap_params=cap_params, temperature=temperature, sm_scale=sm_scale,
      z_loss_weight=z_loss_weight, return_lse=return_lse)
  spec = call.spec
  compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  qc, kc, vc = (x.astype(compute) for x in (q, k, v))
  # GQA: query head h reads kv head h // G.
  kc = jnp.repeat(kc, spec.group_size, axis=2)
  vc = jnp.repeat(vc, spec.group_size, axis=2)
  temp = None if call.temperature is None else jax.lax.stop_gradient(
      call.temperature.astype(compute))
  sinks = None if call.sinks is None else call.sinks.astype(compute)
  seg, kv_seg = call.segment_ids, call.kv_segment_ids

  t, rows = spec.seq_len, rows_per_block(spec)
  if rows == t:
    out, lse = _query_rows(spec, qc, kc, vc, jnp.arange(t) + call.q_offset, seg, kv_seg, temp,
                           sinks)
  else:
    blocks = -(-t // rows)
    pad = blocks * rows - t  # padded query rows see real keys; they are sliced off

    def split(x, axis=1):  # [B, T, ...] -> [blocks, B, rows, ...]
      x = jnp.pad(x, [(0, pad if a == axis else 0) for a in range(x.ndim)])
      x = x.reshape(x.shape[:axis] + (blocks, rows) + x.shape[axis + 1:])
      return jnp.moveaxis(x, axis, 0)

    @jax.checkpoint
    def block(args):
      q_rows, pos, seg_rows, temp_rows = args
      return _query_rows(spec, q_rows, kc, vc, pos, seg_rows, kv_seg, temp_rows, sinks)

    out, lse = jax.lax.map(block, (
        split(qc), jnp.arange(blocks * rows).reshape(blocks, rows) + call.q_offset,
        None if seg is None else split(seg),
        None if temp is None else split(temp)))
    out = jnp.moveaxis(out, 0, 1).reshape((spec.batch, blocks * rows) + out.shape[3:])[:, :t]
    lse = jnp.moveaxis(lse, 0, 2).reshape(lse.shape[1:3] + (blocks * rows,))[..., :t]
  out = out.astype(q.dtype)
  if return_lse:
    return out, lse.astype(jnp.float32) if compute == jnp.float32 else lse
  return out
