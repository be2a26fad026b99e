"""Implementations from "outside" the project, for the suite's own tests: each
is a plain function with the contract's signature and ``ua_*`` declarations,
loaded by the suite as ``outside_kernels:<name>`` (tests put this directory on
PYTHONPATH), as a user's kernel would be.
"""

import functools
import os
import time

import jax
import jax.numpy as jnp

import ua_reference

TILE = 64


def window_bug_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                         cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                         z_loss_weight=0.0, return_lse=False):
  """Attention over 64-row tiles whose window's first key tile is counted back
  from the last visited tile: ``lo = max(hi - (W + 64) // 64, 0)`` (the
  original kernel's defect O3, docs/DEFECTS.md). With causal the last tile is
  the query's own and the bound is nearly right; without it the last tile is
  the sequence's last, and queries more than a tile or two from the end lose
  keys they can see. Only sequences crossing three 64-row tiles show it."""
  b, t, hq, d = q.shape
  g = hq // k.shape[2]
  sm = d ** -0.5 if sm_scale is None else sm_scale
  kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = sm * jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr.astype(jnp.float32))
  mask = ua_reference.visible_keys(t, None, causal, window_len)[0]
  if window_len > 0:
    i, j = jnp.arange(t), jnp.arange(t)
    n_tiles = -(-t // TILE)
    hi = (i // TILE + 1) if causal else jnp.full((t,), n_tiles)
    lo = jnp.maximum(hi - (window_len + TILE) // TILE, 0)
    mask = mask & (j[None, :] // TILE >= lo[:, None])
  logits = jnp.where(mask, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, vr.astype(jnp.float32)).astype(q.dtype)


window_bug_attention.ua_unsupported = {"segment_ids", "cap", "temperature", "z_loss", "lse"}
window_bug_attention.ua_block_sizes = (TILE,)


def _reference_unless(condition, action):
  def attention(q, k, v, **kwargs):
    if condition(q):
      action()
    return ua_reference.attention(q, k, v, **kwargs)
  return attention


def _die():
  os._exit(134)  # what an illegal address or an abort does to the worker


def _hang():
  time.sleep(3600)


# Correct but for sequences longer than 16, where the process dies / hangs.
crashing_attention = _reference_unless(lambda q: q.shape[1] > 16, _die)
hanging_attention = _reference_unless(lambda q: q.shape[1] > 16, _hang)


def off_when_capped_attention(q, k, v, **kwargs):
  """The reference, 1e-3 off whenever a cap is used."""
  out = ua_reference.attention(q, k, v, **kwargs)
  if kwargs.get("cap_method", "none") == "none":
    return out
  if kwargs.get("return_lse"):
    return out[0] * 1.001, out[1]
  return out * 1.001


def tanh_only_attention(q, k, v, **kwargs):
  """The reference, declaring the tanh cap as the only cap method it supports."""
  return ua_reference.attention(q, k, v, **kwargs)


tanh_only_attention.ua_cap_methods = ("tanh",)


def dk_off_when_causal_attention(q, k, v, **kwargs):
  """The reference with dk 1.5 times too large on causal sequences longer than 16, and
  right everywhere else (out, lse, dq, dv; every other case): the planted
  defect tests/test_minimize.py reduces. The forward adds k - stop_gradient(k),
  exactly zero, so only k's cotangent changes."""
  if kwargs.get("causal") and q.shape[1] > 16:
    k = k + 0.5 * (k - jax.lax.stop_gradient(k))
  return ua_reference.attention(q, k, v, **kwargs)


def _bfloat16_out(q, k, v, kwargs, round_bits):
  """The reference computed in float32 with its out rounded to bfloat16 by
  ``round_bits`` (float32 bits -> float32 bits, exact in bfloat16); the
  gradient passes as the identity's."""
  wide = ua_reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), **kwargs)
  out, rest = (wide[0], wide[1:]) if isinstance(wide, tuple) else (wide, ())
  bits = round_bits(jax.lax.bitcast_convert_type(out, jnp.uint32))
  rounded = jax.lax.bitcast_convert_type(bits, jnp.float32)
  out = (out + jax.lax.stop_gradient(rounded - out)).astype(jnp.bfloat16)
  return (out, *rest) if rest else out


@functools.wraps(ua_reference.attention)
def coarse_reference_attention(q, k, v, **kwargs):
  """The reference whose bfloat16 out is rounded to nearest at 7 significant
  bits, not 8: twice the rounding error, far inside the bound
  (tests/test_gates.py's precision regression)."""
  if q.dtype != jnp.bfloat16:
    return ua_reference.attention(q, k, v, **kwargs)
  # to nearest, ties to even, at bit 17
  return _bfloat16_out(q, k, v, kwargs, lambda b: (
      b + jnp.uint32(0xFFFF) + ((b >> 17) & jnp.uint32(1))) & jnp.uint32(0xFFFE0000))


@functools.wraps(ua_reference.attention)
def toward_zero_reference_attention(q, k, v, **kwargs):
  """The reference whose bfloat16 out is rounded toward zero instead of to
  nearest: within one ulp of every element, every element biased toward zero."""
  if q.dtype != jnp.bfloat16:
    return ua_reference.attention(q, k, v, **kwargs)
  return _bfloat16_out(q, k, v, kwargs, lambda b: b & jnp.uint32(0xFFFF0000))
