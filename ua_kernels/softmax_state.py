"""Online-softmax state of one query tile (FlashAttention-2 recurrence)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import fast_math
from .tile_math import Logits, along_rows, dot, exp2_shifted, row_max


class SoftmaxState(NamedTuple):
  """Running row max ``m`` (of Logits.scores), row sum ``l`` and unnormalised
  output ``acc``.

  Rows that have seen no visible key keep ``m = -inf`` and ``l = 0``; the
  updates guard those so an all-masked row never produces NaN. ``l_used``
  (None unless ``sums_rounded``) sums the probabilities as the P @ V product
  used them, rounded to the values' dtype: the output is normalised by it,
  the lse by ``l``. It is a row vector, or (Mosaic) an accumulator of P @ ones
  whose columns are equal, which ``finalize`` reads through ``used_sum``.
  """

  m: jax.Array    # [block_q] float32
  l: jax.Array    # [block_q] float32
  acc: jax.Array  # [block_q, head_dim] float32
  l_used: jax.Array | None = None  # [block_q] or [block_q, columns] float32

  @classmethod
  def init(cls, block_q: int, head_dim: int, fixed_shift: float | None = None,
           rounded_sum: bool = False) -> "SoftmaxState":
    """An empty state; with a ``fixed_shift`` (tile_math.fixed_shift) ``m``
    holds that shift throughout; ``rounded_sum`` (sums_rounded) keeps ``l_used``."""
    m = -jnp.inf if fixed_shift is None else fixed_shift
    zeros = jnp.zeros((block_q,), jnp.float32)
    return cls(jnp.full((block_q,), m, jnp.float32), zeros,
               jnp.zeros((block_q, head_dim), jnp.float32), zeros if rounded_sum else None)

  def step(self, logits: Logits, fixed_shift: float | None = None):
    """One key tile's softmax part: (m, l, correction, p), where the new
    accumulator is correction * acc + p @ v (correction None: acc unscaled).
    Each backend does the p @ v its own way (update: a dot; Mosaic: wgmma).
    With a ``fixed_shift`` the cap bounds the logits: no running max, no rescale."""
    if fixed_shift is None:
      m_new = jnp.maximum(self.m, row_max(logits))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      correction = fast_math.exp2((self.m - m_safe) * logits.scale)
      p = exp2_shifted(logits, m_safe)
      return m_new, correction * self.l + jnp.sum(p, axis=1), correction, p
    p = exp2_shifted(logits, fixed_shift)
    return self.m, self.l + jnp.sum(p, axis=1), None, p

  def update(self, logits: Logits, v: jax.Array, fixed_shift: float | None = None
             ) -> "SoftmaxState":
    """Folds in one key tile: its masked logits (-inf where hidden), values."""
    m, l, correction, p = self.step(logits, fixed_shift)
    acc = self.rescaled_acc(correction) + dot(p.astype(v.dtype), v)
    l_used = None
    if self.l_used is not None:
      l_used = (jnp.sum(p.astype(v.dtype).astype(jnp.float32), axis=1)
                + _rescaled(correction, self.l_used))
    return SoftmaxState(m, l, acc, l_used)

  def rescaled_acc(self, correction):
    """The accumulator times step's per-row correction (None: unchanged)."""
    return _rescaled(correction, self.acc)

  def rescaled_used(self, correction):
    """``l_used`` times step's per-row correction (None: unchanged, or no l_used)."""
    return None if self.l_used is None else _rescaled(correction, self.l_used)

  def used_sum(self):
    """``l_used`` as a row vector (None without it): an accumulator's columns
    are equal, and their max is any of them, exactly."""
    if self.l_used is None or self.l_used.ndim == 1:
      return self.l_used
    return jnp.max(self.l_used, axis=1)

  def with_sink(self, sink, scale: float) -> "SoftmaxState":
    """The state with one more logit of value zero, ``sink`` (scores' units, a
    scalar or [block_q]), in the max and the sums: docs/SEMANTICS.md's sinks.
    The running max only (fixed_shift leaves sinks out)."""
    m = jnp.maximum(self.m, sink)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    correction = fast_math.exp2((self.m - m_safe) * scale)
    p_sink = jnp.broadcast_to(fast_math.exp2((sink - m_safe) * scale), self.l.shape)
    l_used = self.rescaled_used(correction)
    if l_used is not None:
      l_used = l_used + (p_sink if l_used.ndim == 1 else along_rows(p_sink, l_used))
    return SoftmaxState(m, correction * self.l + p_sink, self.rescaled_acc(correction), l_used)

  def finalize(self, scale: float, with_low: bool = False):
    """Returns (out, shift, low): the row statistics from which the backward
    recomputes the probabilities, exp2((scores - shift) * scale - low)
    (tile_math.probabilities); a row with no visible key gives out 0 and
    shift -inf. The caller's base-2 lse is shift * scale + low (lse2).

    ``with_low`` keeps the forward's own two terms, shift = the row max and
    low = log2 of the row sum, so that the backward's probabilities are the
    forward's to the last rounding; without, low is None and shift is
    m + log2(l) / scale, one float32 whose rounding moves every probability of
    a row by the same factor. Summed over thousands of rows in a float32 dk
    that bias was 90 units in the last place (docs/DEFECTS.md, D32); a 16-bit
    gradient's rounding hides it."""
    has_key = self.l > 0
    l_safe = jnp.where(has_key, self.l, 1.0)
    used = self.used_sum()
    used = l_safe if used is None else jnp.where(has_key, used, 1.0)
    # A reciprocal per row, not a division per element: the same time and the
    # same bits on the GPU (docs/HISTORY.md, "What moved the forward").
    out = self.acc * along_rows(1.0 / used, self.acc)
    log_l = fast_math.log2(l_safe)
    if with_low:
      return out, jnp.where(has_key, self.m, -jnp.inf), jnp.where(has_key, log_l, 0.0)
    return out, jnp.where(has_key, self.m + log_l * (1.0 / scale), -jnp.inf), None


def sums_rounded(spec, value_dtype) -> bool:
  """Whether the output is normalised by the rounded probabilities' sum.

  P @ V takes P rounded to 16 bits. Under a cap most logits sit on the cap's
  bounds, a row's probabilities take a few values, each rounded the same way,
  and dividing by the unrounded sum scaled every element of the row one way:
  bfloat16 out 0.27-0.42 ulp toward zero on average (docs/DEFECTS.md, B33).
  Dividing by the sum of what the product used makes the weights sum to one.
  Without a cap the logits are continuous and the roundings independent
  (no bias measured there, ties included): the plain call keeps one sum."""
  return jnp.dtype(value_dtype) != jnp.dtype(jnp.float32) and spec.cap_method != "none"


def _rescaled(correction, x):
  """``x`` ([block_q] or [block_q, n]) times a per-row correction (None: unchanged)."""
  if correction is None:
    return x
  return correction * x if x.ndim == 1 else along_rows(correction, x) * x


def combine_splits(out, shift, low, scale: float, with_low: bool, sink=None):
  """(out, shift, low) of one softmax from S partial ones over disjoint key
  ranges (split-K), as finalize would give them for all the keys at once:
  ``out`` [S, B, T, H, D] float32 and ``shift``, ``low`` [S, B, H, T] as
  finalize(with_low=True) leaves each split. Each split weighs by its share of
  the row's mass, 2^((shift - max) * scale + low); ``sink`` [H] (scores'
  units) joins the mass with a value of zero, as with_sink does."""
  m = jnp.max(shift, axis=0)
  if sink is not None:
    sink = sink[None, :, None]
    m = jnp.maximum(m, sink)
  m_safe = jnp.where(m == -jnp.inf, 0.0, m)
  mass = jnp.where(shift == -jnp.inf, 0.0, jnp.exp2((shift - m_safe) * scale + low))
  total = jnp.sum(mass, axis=0)
  if sink is not None:
    total = total + jnp.exp2((sink - m_safe) * scale)
  has_key = total > 0
  share = mass / jnp.where(has_key, total, 1.0)  # [S, B, H, T]
  out = jnp.sum(jnp.transpose(share, (0, 1, 3, 2))[..., None] * out, axis=0)
  log_l = jnp.log2(jnp.where(has_key, total, 1.0))
  if with_low:
    return out, jnp.where(has_key, m, -jnp.inf), jnp.where(has_key, log_l, 0.0)
  return out, jnp.where(has_key, m + log_l * (1.0 / scale), -jnp.inf), None
