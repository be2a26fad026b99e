"""Tile-level math shared by the forward, dq and dk/dv kernels.

One mask builder, one logits function, one logits gradient and one pair of
block-range functions: the three kernels differ only in what they loop over
and what they accumulate, so every masking or capping rule lives here once.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .contract import StaticSpec

# Logits are carried in base-2 units (x * log2 e) so the kernels use exp2,
# which lowers to a cheaper GPU instruction sequence than exp; lse is
# converted back to natural log on the way out.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def dot(a, b, *, trans_a=False, trans_b=False):
  """a @ b (optionally transposed) accumulated in float32.

  HIGHEST precision keeps float32 inputs out of TF32 on the GPU; 16-bit
  inputs go to the tensor cores as they are.
  """
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def positions(start, size):
  return start + jnp.arange(size, dtype=jnp.int32)


def visible_mask(spec: StaticSpec, q_pos, k_pos, q_seg, k_seg, *, padded: bool):
  """[block_q, block_kv] bool: key j visible to query i; None if all visible.

  ``padded`` says the sequence was padded to a block multiple, so positions
  >= seq_len (queries and keys) are hidden too.
  """
  conditions = []
  if padded:
    conditions.append((q_pos[:, None] < spec.seq_len) & (k_pos[None, :] < spec.seq_len))
  if q_seg is not None:
    conditions.append(q_seg[:, None] == k_seg[None, :])
  if spec.causal:
    conditions.append(k_pos[None, :] <= q_pos[:, None])
  if spec.window_len > 0:
    conditions.append(k_pos[None, :] > q_pos[:, None] - spec.window_len)
  if not conditions:
    return None
  mask = conditions[0]
  for c in conditions[1:]:
    mask = mask & c
  return mask


def tile_logits(spec: StaticSpec, q, k, temp, mask):
  """Returns (scaled, logits2): scaled = sm_scale*q@k^T; logits2 = the contract's
  logits (capped, temperature-scaled, in that order) in base-2 units, masked to
  -inf where hidden. Without a cap the two scales fold into one multiply."""
  qk = dot(q, k, trans_b=True)
  if spec.cap_method == "none":
    scaled = None
    logits = qk * (spec.sm_scale * LOG2E)
  else:
    scaled = qk * spec.sm_scale
    logits = spec.cap.forward(scaled, *spec.cap_params) * LOG2E
  if temp is not None:
    logits = logits * temp[:, None]
  if mask is not None:
    logits = jnp.where(mask, logits, -jnp.inf)
  return scaled, logits


def probabilities(logits, lse):
  """Softmax probabilities from base-2 logits and the saved (natural) lse;
  rows with lse = -inf give 0."""
  lse2 = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)
  return jnp.exp2(logits - lse2[:, None])


def logits_grad(spec: StaticSpec, p, dp, delta, scaled, temp):
  """d loss / d scaled, from dp = dO @ V^T and delta = rowsum(dO*O) - dlse - w*lse.

  Softmax: dlogits = p * (dp - delta). Chain back through temperature and the
  cap's hand-written derivative; sm_scale is applied here too, so callers only
  multiply by K (for dq) or Q (for dk).
  """
  ds = p * (dp - delta[:, None])
  if temp is not None:
    ds = ds * temp[:, None]
  if spec.cap_method != "none":
    ds = ds * spec.cap.grad(scaled, *spec.cap_params)
  return ds * spec.sm_scale


def _div(a, b: int):
  # An int32 divisor: under jax_enable_x64 a Python int would become int64.
  return lax.div(a, jnp.int32(b))


def _ceil_div(a, b: int):
  return _div(a + (b - 1), b)


def kv_block_range(spec: StaticSpec, q_start, block_q, block_kv):
  """[lo, hi) of key blocks that the query tile at q_start can see at all."""
  num_blocks = -(-spec.seq_len // block_kv)
  lo = jnp.int32(0)
  hi = jnp.int32(num_blocks)
  if spec.causal:
    hi = jnp.minimum(_ceil_div(q_start + block_q, block_kv), hi)
  if spec.window_len > 0:
    lo = _div(jnp.maximum(q_start - (spec.window_len - 1), 0), block_kv)
  return lo, hi


def q_block_range(spec: StaticSpec, k_start, block_q, block_kv):
  """[lo, hi) of query blocks that can see some key of the tile at k_start."""
  num_blocks = -(-spec.seq_len // block_q)
  lo = jnp.int32(0)
  hi = jnp.int32(num_blocks)
  if spec.causal:
    lo = _div(k_start, block_q)
  if spec.window_len > 0:
    hi = jnp.minimum(_ceil_div(k_start + block_kv - 1 + spec.window_len, block_q), hi)
  return lo, hi
