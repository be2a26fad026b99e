"""Tile-level math shared by the forward, dq and dk/dv kernels.

One mask builder, one logits function, one logits gradient and one pair of
block-range functions: the three kernels differ only in what they loop over
and what they accumulate, so every masking or capping rule lives here once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ua_reference.contract import StaticSpec

from . import fast_math
from .cap_forms import forms

# Logits are carried in base-2 units (x * log2 e) so the kernels use exp2,
# which lowers to a cheaper GPU instruction sequence than exp. The kernels
# keep lse in base 2 too (lse2); the wrapper converts it for the caller once.
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


def gradient_product(a, b, *, trans_a=False, trans_b=False):
  """One tile's term of a gradient summed over the sequence (dq over key tiles,
  dk and dv over query tiles): dot(a, b), to be added to the running sum.

  For float32 operands the term is rounded once before that add. Triton's
  combine pass rewrites ``total + dot(a, b)`` into a dot that accumulates into
  ``total`` (``AddFOp(DotOp(a, b, 0), d) => DotOp(a, b, d)``), so a float32
  (FMA) dot adds every product of every tile into the running sum, rounding
  each at the sum's magnitude: a float32 dk of long sequences fell out of its
  tolerance (docs/DEFECTS.md, D32). Halving ``a`` and
  doubling the product puts a multiply between the dot and the add, which the
  pattern does not match; both are exact in float32 (``a`` above 2^-125, the
  product below 2^127). 16-bit operands keep the fused form: the output's
  rounding hides the difference (docs/DEFECTS.md, G1)."""
  if a.dtype != jnp.float32:
    return dot(a, b, trans_a=trans_a, trans_b=trans_b)
  return dot(a * 0.5, b, trans_a=trans_a, trans_b=trans_b) * 2.0


def positions(start, size):
  return start + jnp.arange(size, dtype=jnp.int32)


def along_rows(x, like):
  """A per-row vector ([block_q]) broadcast to the tile ``like``. Explicit
  broadcast_in_dim, not x[:, None]: Mosaic GPU lays out a [block_q, 1] array
  nowhere, Triton and the interpreter take either."""
  return lax.broadcast_in_dim(x, like.shape, (0,))


def along_queries(x, like, query_axis: int):
  """A per-query vector broadcast to the tile ``like``, whose queries lie
  along ``query_axis`` (Logits.query_axis)."""
  return lax.broadcast_in_dim(x, like.shape, (query_axis,))


def _tile_grid(x, shape, axis):
  """A per-row (axis 0) or per-column (axis 1) vector as a ``shape`` tile; a
  tile already (Mosaic builds its positions with a layout) passes through."""
  return x if x.ndim == 2 else lax.broadcast_in_dim(x, shape, (axis,))


def visible_mask(spec: StaticSpec, q_pos, k_pos, q_seg, k_seg, *, padded: bool,
                 query_axis: int = 0, delta=None):
  """bool tile: key j visible to query i; None if all visible.

  Positions and segment ids come as vectors or as whole tiles. The tile holds
  queries along ``query_axis`` ([block_q, block_kv] for 0; the dk/dv kernel of
  the Mosaic backend scores keys against queries, [block_kv, block_q], for 1).
  ``padded`` says the sequences were padded to a block multiple, so queries
  from spec.seq_len and keys from spec.kv_seq_len on are hidden too. ``delta`` (an int32 scalar,
  or None for 0): the queries' positions lie ``delta`` after the keys' (a key
  block of another shard, context_parallel), for causality and the window.
  """
  key_axis = 1 - query_axis
  if q_pos.ndim == 2:
    shape = q_pos.shape
  elif k_pos.ndim == 2:
    shape = k_pos.shape
  else:
    shape = [0, 0]
    shape[query_axis], shape[key_axis] = q_pos.shape[0], k_pos.shape[0]
    shape = tuple(shape)
  q_pos, k_pos = _tile_grid(q_pos, shape, query_axis), _tile_grid(k_pos, shape, key_axis)
  conditions = []
  if padded:
    conditions.append((q_pos < spec.seq_len) & (k_pos < spec.kv_seq_len))
  if q_seg is not None:
    conditions.append(_tile_grid(q_seg, shape, query_axis) == _tile_grid(k_seg, shape, key_axis))
  if delta is not None:
    k_pos = k_pos - delta
  if spec.causal:
    conditions.append(k_pos <= q_pos)
  if spec.window_len > 0:
    conditions.append(k_pos > q_pos - spec.window_len)
  if not conditions:
    return None
  mask = conditions[0]
  for c in conditions[1:]:
    mask = mask & c
  return mask


class Logits(NamedTuple):
  """One tile's logits in base-2 units, as ``scores * scale``.

  ``scale`` is a positive static float that the kernels fold into the exp2's
  argument, ``exp2((scores - m) * scale)`` with m a row's max of ``scores``:
  the difference is exact where a probability is not negligible, so the
  argument errs by one rounding of its own size however large the logits
  (``scores * scale - m * scale`` errs by half an ulp of the logit, whole
  units past 2^24 and past exp2's range at 2^31; docs/DEFECTS.md, L1).
  The cap was evaluated as ``cap(cap_arg, *cap_params)``; its derivative needs
  the same (cap_arg is None without a cap). ``query_axis``: the tile's axis of
  queries (0: [block_q, block_kv]; 1: keys scored against queries), along
  which per-query vectors (lse, delta, temperature) broadcast.
  """

  scores: jax.Array
  scale: float
  cap_arg: jax.Array | None
  cap_params: tuple[float, ...]
  query_axis: int = 0


def _cap_fold(spec: StaticSpec) -> tuple[float, float, tuple[float, ...]]:
  """(factor on q.k, exp2 scale, parameters) with which tile_logits evaluates
  the cap: for a homogeneous cap, cap(s*qk; p) = p0 * cap(s*qk/p0; p/p0), so
  p0 joins the exp2's scale."""
  if spec.cap.homogeneous and spec.cap_params:
    p0 = spec.cap_params[0]
    return spec.sm_scale / p0, p0 * LOG2E, tuple(c / p0 for c in spec.cap_params)
  return spec.sm_scale, LOG2E, spec.cap_params


def _exp2_factor(spec: StaticSpec) -> float:
  """What multiplies the (capped) scores into base-2 logits: sm_scale * log2(e)
  without a cap, the cap's fold with one (_cap_fold)."""
  return spec.sm_scale * LOG2E if spec.cap_method == "none" else _cap_fold(spec)[1]


def _scale_in_exp2(scale: float, has_temperature: bool) -> bool:
  """Whether the exp2's multiply may wait until after the row max (Logits.scale):
  not under a per-row temperature (of either sign), nor for a scale <= 0,
  which does not commute with the max (nor -inf * 0 with the mask)."""
  return not has_temperature and scale > 0


# Widest range, in base-2 units, of the logits a cap allows for which the
# forward may shift its exp2 by a constant (fixed_shift): probabilities then
# lie within 2^(+-50), so a row's sums stay finite and its largest terms stay
# normal floats for any |v| in [2^-76, 2^78 / T] (docs/SEMANTICS.md).
FIXED_SHIFT_MAX_SPAN = 100.0


def fixed_shift(spec: StaticSpec, dtype, has_temperature: bool) -> float | None:
  """The forward's constant shift of the scores (Logits.scores' units) when the
  cap bounds every logit, else None.

  A cap whose outputs lie in [lo, hi] (CapMethod.bounds) bounds the base-2
  logits to [lo, hi] * scale; shifting by the midpoint instead of the running
  row max drops the max, the rescale of the accumulator and one exp2 per row
  from every key tile. Only where that is exact in range: no temperature (it
  would scale the bounds per row), a span of at most FIXED_SHIFT_MAX_SPAN, and
  bfloat16 or float32 inputs (the probabilities are cast to the input dtype for
  the p @ v product; float16 cannot hold 2^50). A sink is not capped: none.
  """
  if (spec.cap.bounds is None or has_temperature or spec.has_sinks
      or jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))):
    return None
  _, scale, params = _cap_fold(spec)
  lo, hi = spec.cap.bounds(*params)
  if (hi - lo) * scale > FIXED_SHIFT_MAX_SPAN:
    return None
  return 0.5 * (lo + hi)


def tile_logits(spec: StaticSpec, q, k, temp, mask, fast_cap: bool) -> Logits:
  """The contract's logits of q @ k^T; see scores_to_logits."""
  return scores_to_logits(spec, scores_product(q, k), temp, mask, fast_cap)


def scores_product(q, k):
  """q @ k^T in float32. In the Pallas interpreter (fast_math.native(None)) the
  sum over the head dim runs in one fixed order, so that a logit has the same
  bits in every kernel whatever its tile's shape: XLA:CPU's dot rounds by the
  product's shape, and at large logits one ulp of a score moves a probability
  by whole factors between the forward and the backward (docs/DEFECTS.md, L1).
  Compiled, the GPU's dot is used as it is."""
  if fast_math.native_backend() is not None:
    return dot(q, k, trans_b=True)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)

  def add_column(d, acc):
    column = lambda x: lax.dynamic_slice_in_dim(x, d, 1, axis=1)
    return acc + column(q) * jnp.transpose(column(k))

  return lax.fori_loop(0, q.shape[1], add_column,
                       jnp.zeros((q.shape[0], k.shape[0]), jnp.float32))


def scores_to_logits(spec: StaticSpec, qk, temp, mask, fast_cap: bool,
                     query_axis: int = 0) -> Logits:
  """The contract's logits (capped, then temperature-scaled) of the float32
  scores q.k, masked to -inf where hidden. ``fast_cap`` selects the cap's fast
  form (bfloat16; cap_forms). Every backend computes qk its own way (a Triton
  dot, a Mosaic wgmma) and its logits here; ``query_axis`` 1 takes the scores
  transposed (keys by queries).

  A cap declared homogeneous, cap(a*x; a*p) = a*cap(x; p) for a > 0, is
  evaluated with its first parameter p0 moved out, p0 * cap(sm_scale*q.k/p0; p/p0),
  and p0 left to the exp2's multiply: for the tanh cap, tanh(q.k * sm_scale/c)
  is one multiply and one tanh per logit, the same function as c*tanh(s/c).
  """
  scale = _exp2_factor(spec)
  if spec.cap_method == "none":
    scores, cap_arg, params = qk, None, ()
  else:
    arg_scale, _, params = _cap_fold(spec)
    cap_arg = qk * arg_scale
    cap_forward, _ = forms(spec.cap, fast_cap)
    scores = cap_forward(cap_arg, *params)
  if not _scale_in_exp2(scale, temp is not None):  # multiply first
    scores = scores * (scale if temp is None
                       else along_queries(temp * scale, scores, query_axis))
    scale = 1.0
  if mask is not None:
    scores = jnp.where(mask, scores, -jnp.inf)
  return Logits(scores, scale, cap_arg, params, query_axis)


def row_max(logits: Logits):
  """Per-query max of the scores (Logits.scores' units; scale > 0 commutes
  with max)."""
  return jnp.max(logits.scores, axis=1 - logits.query_axis)


def exp2_shifted(logits: Logits, shift, low=None):
  """exp2((scores - shift) * scale - low); ``shift`` is in the scores' units,
  one value per row or a static float (fixed_shift), ``low`` (per row, base 2)
  or None. The subtraction comes first (Logits)."""
  if not isinstance(shift, float):
    shift = along_queries(shift, logits.scores, logits.query_axis)
  shifted = (logits.scores - shift) * logits.scale
  if low is not None:
    shifted = shifted - along_queries(low, shifted, logits.query_axis)
  return fast_math.exp2(shifted)


def probabilities(logits: Logits, shift, low=None):
  """Softmax probabilities from the forward's row statistics
  (SoftmaxState.finalize): exp2((scores - shift) * scale - low), rows with
  shift = -inf (no visible key) giving 0. With ``low`` (float32 kernels) shift
  is the row's max score and low log2 of its sum, the forward's own terms."""
  return exp2_shifted(logits, jnp.where(shift == -jnp.inf, jnp.inf, shift), low)


def exp2_scale(spec: StaticSpec, has_temperature: bool) -> float:
  """The Logits.scale of the kernels' tiles (scores_to_logits): what turns the
  row statistics' shift into base-2 units for the caller's lse."""
  scale = _exp2_factor(spec)
  return scale if _scale_in_exp2(scale, has_temperature) else 1.0


def logits_grad(spec: StaticSpec, p, dp, delta, logits: Logits, temp, fast_cap: bool):
  """d loss / d scaled, from dp = dO @ V^T and delta = rowsum(dO*O) - dlse - w*lse.

  Softmax: dlogits = p * (dp - delta). Chain back through temperature and the
  cap's hand-written derivative; sm_scale is applied here too, so callers only
  multiply by K (for dq) or Q (for dk).
  """
  ds = p * (dp - along_queries(delta, p, logits.query_axis))
  if temp is not None:
    ds = ds * along_queries(temp, ds, logits.query_axis)
  if spec.cap_method != "none":
    _, cap_grad = forms(spec.cap, fast_cap)
    ds = ds * cap_grad(logits.cap_arg, *logits.cap_params)
  return ds * spec.sm_scale


# float16's largest finite value is 65504 = 2^16 - 2^5: a ds slice's largest |ds| is
# scaled into [2^14, 2^15), up by a factor of at most 2^63.
_FLOAT16_TOP = 15
_MAX_SCALE_UP = 63


# The R2 lattice's multipliers as 32-bit fractions (0xC13FA9A9, 0x91E10DA5, i.e.
# 2^32 / phi_2 and 2^32 / phi_2^2, phi_2 the plastic number), as int32: dither_bits.
_LATTICE = (-1052792407, -1847521883)


def unbiased_roundings(spec: StaticSpec, dtype) -> tuple[bool, bool]:
  """(P for dv, ds for dq and dk): whether the backward rounds that 16-bit
  operand without bias (round_unbiased) instead of to nearest.

  Under a cap the logits sit on a few values, so a row's probabilities do too
  (P = 1/n on every visible key of a saturated document), and under a z-loss on
  nearly one-hot rows a row's few large ds (w * lse * p) dominate: rounded to
  nearest, each such value rounds the same way on every element it holds, and
  dv, dq and dk moved by 0.4-0.9 ulp, one way per case, every element within
  its bound (docs/DEFECTS.md, B33). Without either the roundings are independent
  and the plain call keeps round-to-nearest (no bias measured there)."""
  if jnp.dtype(dtype) == jnp.dtype(jnp.float32):
    return False, False
  capped = spec.cap_method != "none"
  return capped, capped or spec.z_loss_weight != 0.0


def dither_bits(q_pos, k_pos, operand: int):
  """32 bits per element of a tile (int32) from its query and key position
  tiles: the top bits of frac(q * a + k * b), a two-dimensional Weyl lattice
  (R2), so that along every row and every column (the sums of the backward's
  products) the draws are spread evenly over [0, 1), and a constant value
  rounds up in the share of its elements its fraction of an ulp says. Two
  multiply-adds per element, next to the tile's dozen float operations
  (docs/DEFECTS.md, B33, gives the cost). ``operand`` 0 (P) and 1 (ds) swap a and b:
  the two roundings of one element are drawn apart, and neither tile is kept
  live for the other. Deterministic, and the same on either backend."""
  a, b = _LATTICE if operand == 0 else _LATTICE[::-1]
  return q_pos * jnp.int32(a) + k_pos * jnp.int32(b)


def position_grid(shape, q_start, k_start, query_axis: int = 0):
  """(query positions, key positions) of every element of a tile of ``shape``
  whose queries lie along ``query_axis``: dither_bits's arguments (the Mosaic
  kernels build theirs in wgmma's layout, mosaic.common.position_tiles)."""
  q_len, k_len = shape if query_axis == 0 else shape[::-1]
  return (lax.broadcast_in_dim(positions(q_start, q_len), shape, (query_axis,)),
          lax.broadcast_in_dim(positions(k_start, k_len), shape, (1 - query_axis,)))


def round_unbiased(x, dtype, bits):
  """float32 ``x`` in the 16-bit ``dtype``, rounded away from zero with the
  probability of the fraction of a unit in the last place it drops (stochastic
  rounding), with ``bits`` (dither_bits) as the random draw: the expected value
  is ``x``. The dither goes into the bits rounding drops and those are cleared,
  so the conversion after it is exact (float16 below its normal range,
  2^-14, rounds to nearest there). Zeros stay zero, infinities infinite."""
  drop = 16 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 13
  u = lax.bitcast_convert_type(x, jnp.int32)
  u = (u + lax.shift_right_logical(bits, jnp.int32(32 - drop))) & jnp.int32(-(1 << drop))
  return lax.bitcast_convert_type(u, jnp.float32).astype(dtype)


def to_operand(x, dtype, bits=None):
  """x in the matmul dtype: round_unbiased with ``bits``, else to nearest."""
  return x.astype(dtype) if bits is None else round_unbiased(x, dtype, bits)


def power_of_two(exponent):
  """2^exponent in float32, exactly, from its bits (int32 ``exponent`` in
  float32's normal range, [-126, 127]): no division or log2 in the kernels."""
  return lax.bitcast_convert_type(lax.shift_left(exponent + 127, jnp.int32(23)), jnp.float32)


def range_scaled(dtype) -> bool:
  """Whether matmul_operand scales ds into the matmul dtype's range (float16)."""
  return jnp.dtype(dtype) == jnp.dtype(jnp.float16)


def matmul_operand(ds, dtype, axis: int, bits=None):
  """(ds in the matmul dtype ``dtype``; None, or for float16 the int32
  exponent e of each slice along ``axis``, the operand being ds * 2^e).

  The gradient tiles ds = p * (dp - delta) * temperature * sm_scale feed the
  16-bit tensor cores. bfloat16 has float32's range; float16 ends at 65504,
  and ds passes it where w * lse or the temperature is large (z-loss 1 on rows
  with lse near 10^4, temperature near 50: |ds| up to 7.6e4), so the cast gave
  inf where the gradient is finite (docs/DEFECTS.md, F16); and float16's normal
  range starts at 2^-14, below which ds rounds to its subnormal spacing, 2^-24,
  the same way on many elements of nearly one-hot rows (B33: dk biased by half
  an ulp). For float16 each slice along ``axis`` (a query row for dq: axis 1; a
  key column for the Triton dk: axis 0; a key row of the Mosaic dk/dv kernel's
  keys-by-queries tile: axis 1) is scaled by the power of two, exact, that
  brings its largest |ds| into [2^14, 2^15) (at most 2^63: a slice below
  2^-49 stays below; a slice of zeros, or of float32 subnormals, is left as it
  is), read off that largest value's exponent bits, and the caller scales
  that row of the product back (scaled_back). ``bits`` (dither_bits): rounded
  without bias (unbiased_roundings)."""
  if not range_scaled(dtype):
    return to_operand(ds, dtype, bits), None
  big = jnp.max(jnp.abs(ds), axis=axis)
  # big lies in [2^(b - 127), 2^(b - 126)) for its biased exponent b (0: zero or
  # subnormal), so 2^(127 + 14 - b) brings it into [2^14, 2^15).
  biased = lax.shift_right_logical(lax.bitcast_convert_type(big, jnp.int32), jnp.int32(23))
  exponent = jnp.where(biased == 0, jnp.int32(0),
                       jnp.minimum(jnp.int32(127 + _FLOAT16_TOP - 1) - biased,
                                   jnp.int32(_MAX_SCALE_UP)))
  scaled = ds * lax.broadcast_in_dim(power_of_two(exponent), ds.shape, (1 - axis,))
  return to_operand(scaled, dtype, bits), exponent


def scaled_back(term, exponent):
  """A product of matmul_operand's operand, its rows scaled back by 2^-exponent
  (None: unscaled)."""
  return term if exponent is None else along_rows(power_of_two(-exponent), term) * term


def rescaled(term, exponent, to_exponent):
  """A term whose rows are in matmul_operand's scale 2^exponent, brought to
  the scale 2^to_exponent. Two exponents of matmul_operand (in [-113, 63] for
  finite ds) lie up to 176 apart, past float32's normal powers of two,
  2^+-126: the step is applied as two factors of at most 2^+-88, exact for
  every pair (one factor clipped to 2^+-126 would mis-scale a row by up to
  2^50; docs/DEFECTS.md, F16)."""
  step = to_exponent - exponent
  half = lax.shift_right_arithmetic(step, jnp.int32(1))
  return along_rows(power_of_two(step - half), term) * (along_rows(power_of_two(half), term)
                                                        * term)


def _div(a, b: int):
  # An int32 divisor: under jax_enable_x64 a Python int would become int64.
  return lax.div(a, jnp.int32(b))


def _ceil_div(a, b: int):
  return _div(a + (b - 1), b)


def kv_block_range(spec: StaticSpec, q_start, block_q, block_kv):
  """[lo, hi) of key blocks that the query tile at q_start can see at all."""
  num_blocks = -(-spec.kv_seq_len // block_kv)
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


class TileMask(enum.IntEnum):
  """What the mask of a tile pair must hide, as tile_loop passes it to its
  body (falsy: nothing, no mask is built)."""

  NONE = 0
  # Causal, window and padding only: every query and key of the pair lies in
  # one run of one segment id, so the segment ids need not be read.
  POSITIONS = 1
  # Positions and segment ids.
  FULL = 2


@dataclasses.dataclass(frozen=True)
class Tiles:
  """A tile loop's range [lo, hi) as consecutive sub-ranges: tiles
  [bounds[i], bounds[i + 1]) run with masks[i] (TileMask). A sub-range that the
  spec leaves empty for every tile position is not listed: each listed one is
  a loop body that the kernels compile. Not a pytree: the masks are static."""

  bounds: tuple
  masks: tuple

  @property
  def lo(self):
    return self.bounds[0]

  @property
  def hi(self):
    return self.bounds[-1]

  def clipped(self, lo, hi) -> "Tiles":
    """The same sub-ranges narrowed to the tiles [lo, hi) (a split of the
    keys, triton.launch's split-K forward): the bounds are monotonic, so
    clipping each clips every sub-range, empty ones included."""
    return Tiles(tuple(jnp.minimum(jnp.maximum(b, lo), hi) for b in self.bounds), self.masks)


def _has_unmasked_interior(spec: StaticSpec, padded: bool, uniform) -> bool:
  """Tiles wholly inside the causal/window band, and with segment ids inside
  the tile's run of one id (``uniform``), need no mask; padding needs one
  everywhere, as do segment ids without their runs."""
  if padded or (spec.has_segment_ids and uniform is None):
    return False
  return spec.causal or spec.window_len > 0 or spec.has_segment_ids


def _within_span(lo, hi, span, block: int):
  """[lo, hi) of tiles of ``block`` positions narrowed to the tiles that meet
  the positions [span_lo, span_hi) (no change when span is None)."""
  if span is None:
    return lo, hi
  span_lo, span_hi = span
  return jnp.maximum(lo, _div(span_lo, block)), jnp.minimum(hi, _ceil_div(span_hi, block))


def _nested(a, b, lo, hi):
  """[a, b) clipped into [lo, hi), with lo <= a <= b <= hi (empty at worst)."""
  a = jnp.minimum(jnp.maximum(a, lo), hi)
  return a, jnp.minimum(jnp.maximum(b, a), hi)


def _split(lo, hi, band_lo, band_hi, uniform, block: int, interior: bool,
           cut_lo: bool, cut_hi: bool) -> Tiles:
  """Tiles [lo, hi) in sub-ranges: outside ``uniform``'s run of one id (a
  full mask), inside it (a mask by position), and, when the loop has an
  ``interior`` without a mask, inside both the run and the band [band_lo,
  band_hi) of tiles visible by position. ``cut_lo``/``cut_hi``: whether the
  band can end inside the range on that side (a window, causality); where it
  cannot, the sub-range between band and run is empty and left out."""
  if uniform is None:
    if not interior:
      return Tiles((lo, hi), (TileMask.FULL,))
    masked, (run_lo, run_hi) = TileMask.FULL, (lo, hi)
    outer_lo, outer_hi = (), ()
  else:
    uniform_lo, uniform_hi = uniform
    run_lo, run_hi = _nested(_ceil_div(uniform_lo, block), _div(uniform_hi, block), lo, hi)
    if not interior:
      return Tiles((lo, run_lo, run_hi, hi),
                   (TileMask.FULL, TileMask.POSITIONS, TileMask.FULL))
    masked = TileMask.POSITIONS
    outer_lo, outer_hi = ((lo, TileMask.FULL),), ((run_hi, TileMask.FULL),)
  full_lo, full_hi = _nested(band_lo, band_hi, run_lo, run_hi)
  parts = (*outer_lo, *(((run_lo, masked),) if cut_lo else ()), (full_lo, TileMask.NONE),
           *(((full_hi, masked),) if cut_hi else ()), *outer_hi)
  # The first part starts at lo (full_lo is lo where it comes first).
  return Tiles((lo, *(b for b, _ in parts[1:]), hi), tuple(m for _, m in parts))


def kv_tiles(spec: StaticSpec, q_start, block_q, block_kv, padded: bool, span=None,
             uniform=None, delta=None) -> Tiles:
  """The key tiles a query tile visits (Tiles). ``span``: the positions
  [lo, hi) that share a segment with some query of the tile (segment ids);
  ``uniform``: the positions [lo, hi) of one run of one segment id that holds
  every query of the tile (empty when the tile holds two runs), so that key
  tiles inside it need no segment mask (segment_spans.segment_runs);
  ``delta``: as visible_mask's (the tile's queries sit at q_start + delta in
  the keys' positions; bounds that come out negative leave their loops empty)."""
  if delta is not None:
    q_start = q_start + delta
  lo, hi = _within_span(*kv_block_range(spec, q_start, block_q, block_kv), span, block_kv)
  band_lo, band_hi = lo, hi
  if spec.window_len > 0:  # first key of the tile within every query's window
    band_lo = _ceil_div(jnp.maximum(q_start + block_q - spec.window_len, 0), block_kv)
  if spec.causal:  # last key of the tile <= first query of the tile
    band_hi = _div(q_start + 1, block_kv)
  return _split(lo, hi, band_lo, band_hi, uniform, block_kv,
                _has_unmasked_interior(spec, padded, uniform), spec.window_len > 0, spec.causal)


def q_tiles(spec: StaticSpec, k_start, block_q, block_kv, padded: bool, span=None,
            uniform=None, delta=None) -> Tiles:
  """The query tiles that a key tile visits (Tiles); see kv_tiles."""
  if delta is not None:
    k_start = k_start - delta
  lo, hi = q_block_range(spec, k_start, block_q, block_kv)
  if delta is not None:  # a key tile before the first query: lax.div rounds toward zero
    lo = jnp.maximum(lo, 0)
  lo, hi = _within_span(lo, hi, span, block_q)
  band_lo, band_hi = lo, hi
  if spec.causal:  # first query of the tile >= last key of the tile
    band_lo = _ceil_div(k_start + block_kv - 1, block_q)
  if spec.window_len > 0:  # last query of the tile within the first key's window
    band_hi = _div(k_start + spec.window_len, block_q)
  return _split(lo, hi, band_lo, band_hi, uniform, block_q,
                _has_unmasked_interior(spec, padded, uniform), spec.causal, spec.window_len > 0)


def tile_loop(tiles: Tiles, body, carry):
  """Runs ``body(tile, carry, mask)`` over the tiles in order, ``mask`` the
  TileMask of the tile's sub-range."""
  for a, b, mask in zip(tiles.bounds, tiles.bounds[1:], tiles.masks):
    carry = lax.fori_loop(a, b, lambda i, c, mask=mask: body(i, c, mask), carry)
  return carry
