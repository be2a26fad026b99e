"""Online-softmax state of one query tile (FlashAttention-2 recurrence)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import fast_math
from .tile_math import Logits, along_rows, dot, exp2_shifted, row_max


class SoftmaxState(NamedTuple):
  """Running row max ``m``, row sum ``l`` and unnormalised output ``acc``.

  Rows that have seen no visible key keep ``m = -inf`` and ``l = 0``; the
  updates guard those so an all-masked row never produces NaN.
  """

  m: jax.Array    # [block_q] float32
  l: jax.Array    # [block_q] float32
  acc: jax.Array  # [block_q, head_dim] float32

  @classmethod
  def init(cls, block_q: int, head_dim: int, fixed_shift: float | None = None
           ) -> "SoftmaxState":
    """An empty state; with a ``fixed_shift`` (tile_math.fixed_shift) ``m``
    holds that shift throughout."""
    m = -jnp.inf if fixed_shift is None else fixed_shift
    return cls(jnp.full((block_q,), m, jnp.float32),
               jnp.zeros((block_q,), jnp.float32),
               jnp.zeros((block_q, head_dim), jnp.float32))

  def step(self, logits: Logits, fixed_shift: float | None = None):
    """One key tile's softmax part: (m, l, correction, p), where the new
    accumulator is correction * acc + p @ v (correction None: acc unscaled).
    Each backend does the p @ v its own way (update: a dot; Mosaic: wgmma).
    With a ``fixed_shift`` the cap bounds the logits: no running max, no rescale."""
    if fixed_shift is None:
      m_new = jnp.maximum(self.m, row_max(logits))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      correction = fast_math.exp2(self.m - m_safe)
      p = exp2_shifted(logits, m_safe)
      return m_new, correction * self.l + jnp.sum(p, axis=1), correction, p
    p = exp2_shifted(logits, fixed_shift)
    return self.m, self.l + jnp.sum(p, axis=1), None, p

  def update(self, logits: Logits, v: jax.Array, fixed_shift: float | None = None
             ) -> "SoftmaxState":
    """Folds in one key tile: its masked logits (-inf where hidden), values."""
    m, l, correction, p = self.step(logits, fixed_shift)
    return SoftmaxState(m, l, self.rescaled_acc(correction) + dot(p.astype(v.dtype), v))

  def rescaled_acc(self, correction):
    """The accumulator times step's per-row correction (None: unchanged)."""
    return self.acc if correction is None else along_rows(correction, self.acc) * self.acc

  def finalize(self, with_low: bool = False):
    """Returns (out, lse2), lse2 the log-sum-exp in base 2 (what the backward
    needs, without a second rounding); a row with no visible key gives (0, -inf).

    ``with_low`` also returns lse2_low, the part of m + log2(l) that rounding
    lse2 to float32 lost (0 on rows without a key), so that the backward's
    probabilities exp2((x - lse2) - lse2_low) are those of the forward. Where
    the logits are large, lse2 alone is not enough: for |lse2| in [2^10, 2^11)
    its spacing is 2^-13, and a row whose softmax is nearly one-hot has
    log2(l) < 2^-14, which rounding lse2 loses entirely, always in the same
    direction; every probability of the row is then off by the same factor,
    and a float32 dk summing thousands of such rows was off by 90 units in the
    last place, past its tolerance (docs/DEFECTS.md, D32)."""
    has_key = self.l > 0
    l_safe = jnp.where(has_key, self.l, 1.0)
    # A reciprocal per row, not a division per element: on the H200 the same
    # time and the same bits (docs/BENCHMARKS.md, "What moved the forward");
    # the benchmark tables were measured with it.
    out = self.acc * along_rows(1.0 / l_safe, self.acc)
    log_l = fast_math.log2(l_safe)
    lse2 = jnp.where(has_key, self.m + log_l, -jnp.inf)
    if not with_low:
      return out, lse2
    m_safe = jnp.where(has_key, self.m, 0.0)  # no -inf - -inf on rows without a key
    low = rounding_error(m_safe, log_l, m_safe + log_l)
    return out, lse2, jnp.where(has_key, low, 0.0)


def rounding_error(a, b, total):
  """(a + b) - total exactly, for total = fl(a + b) (Knuth's TwoSum: six float
  operations, exact in round-to-nearest for any order of magnitude of a and b)."""
  b_part = total - a
  a_part = total - b_part
  return (a - a_part) + (b - b_part)
