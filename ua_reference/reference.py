"""The oracle: docs/SEMANTICS.md written as plain jnp, to be read.

Computes in float32 for 16/32-bit inputs and float64 for float64 inputs, and
takes every gradient from autodiff. The only non-autodiff piece is the z-loss:
the contract says its gradient is added "as if the caller had added
1/2 * w * sum(lse^2) to the loss", a term no output carries, so a one-line
custom_vjp identity on lse injects ``w * lse`` into lse's cotangent.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ua_kernels.contract import validate


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _with_z_loss_gradient(lse, weight):
  return lse


def _with_z_loss_fwd(lse, weight):
  return lse, lse


def _with_z_loss_bwd(weight, lse, g):
  return (g + weight * jnp.where(jnp.isfinite(lse), lse, 0.0),)


_with_z_loss_gradient.defvjp(_with_z_loss_fwd, _with_z_loss_bwd)


def visible_keys(seq_len, segment_ids, causal, window_len):
  """Boolean [B or 1, T, T] mask: key j is visible to query i."""
  i = jnp.arange(seq_len)[:, None]
  j = jnp.arange(seq_len)[None, :]
  mask = jnp.ones((1, seq_len, seq_len), bool)
  if segment_ids is not None:
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
  if causal:
    mask = mask & (j <= i)
  if window_len > 0:
    mask = mask & (j > i - window_len)
  return mask


def attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
              cap_method="none", cap_params=(), temperature=None, sm_scale=None,
              z_loss_weight=0.0, return_lse=False, config=None):
  """Reference unified attention; ``config`` is accepted and ignored."""
  del config
  spec, segment_ids, temperature = validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, z_loss_weight=z_loss_weight, return_lse=return_lse)
  compute = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
  qc, kc, vc = (x.astype(compute) for x in (q, k, v))
  # GQA: query head h reads kv head h // G.
  kc = jnp.repeat(kc, spec.group_size, axis=2)
  vc = jnp.repeat(vc, spec.group_size, axis=2)

  # Order of the contract: scale, cap, temperature, then masking.
  scaled = spec.sm_scale * jnp.einsum(
      "bqhd,bkhd->bhqk", qc, kc, precision=jax.lax.Precision.HIGHEST)
  logits = spec.cap.forward(scaled, *spec.cap_params)
  if temperature is not None:
    temp = jax.lax.stop_gradient(temperature.astype(compute))  # no gradient
    logits = logits * jnp.transpose(temp, (0, 2, 1))[..., None]
  mask = visible_keys(spec.seq_len, segment_ids, spec.causal, spec.window_len)
  mask = jnp.broadcast_to(mask[:, None], logits.shape)

  # Rows with no visible key: out 0, lse -inf, zero gradients (double where).
  row_max = jnp.max(jnp.where(mask, logits, -jnp.inf), axis=-1, keepdims=True)
  row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
  exps = jnp.where(mask, jnp.exp(jnp.where(mask, logits, row_max) - row_max), 0.0)
  total = jnp.sum(exps, axis=-1)
  has_key = total > 0
  lse = jnp.where(has_key, jnp.log(jnp.where(has_key, total, 1.0)) + row_max[..., 0],
                  -jnp.inf)
  if spec.z_loss_weight:
    lse = _with_z_loss_gradient(lse, spec.z_loss_weight)
  safe_lse = jnp.where(has_key, lse, 0.0)
  probs = jnp.where(mask, jnp.exp(jnp.where(mask, logits - safe_lse[..., None], 0.0)), 0.0)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, vc, precision=jax.lax.Precision.HIGHEST)
  out = out.astype(q.dtype)
  if return_lse:
    return out, lse.astype(jnp.float32) if compute == jnp.float32 else lse
  return out
