"""Bias: a systematic shift of an output's rounding, which a max-abs bound
cannot see (round-toward-zero stays within one ulp of every element, inside
the bound, and moves every element the same way; a biased gradient is what
training accumulates).

Each element is compared with the same-precision reference (ua_reference on
the case's dtype, computed with the oracle's baseline), projected on the
float64 oracle's sign and measured in ulps of the output's dtype at the
oracle's magnitude: negative is toward zero, positive away from it. Only
where the reference is within REFERENCE_WITHIN_ULPS of the oracle, i.e. is
the oracle's rounding: elements that cancel (a gradient of 1e-10 built of
terms of 1) carry float32 accumulation errors of many of their own ulps, of a
sign the algorithm sets; exact results (0 on a row of one visible key) meet
the oracle's float64 noise, of one sign on a case; a float32 1 - tanh^2 of a
saturated cap is the reference's own error, which a kernel need not share.
None of these says which way a kernel rounds. A correct kernel
rounds to nearest, as the reference does, so its differences are mostly
none, and as often negative as positive; the sign test (scipy.stats.binomtest on the counts of
rows of each sign beyond DEAD_ZONE_ULPS: a row's elements share its factors)
finds a shift, and an effect floor on the
mean difference, clipped to one ulp per element (BIAS_FLOOR_ULPS), keeps a
shift too small to matter from failing however many elements show it. Holm's
correction spans the outputs of one verdict. docs/TOLERANCES.md, "Bias".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import reductions

# Significand bits and smallest normal exponent of the output dtypes.
_SIGNIFICAND = {"float32": 23, "bfloat16": 7, "float16": 10, "float64": 52}
_MIN_EXPONENT = {"float32": -126, "bfloat16": -126, "float16": -14, "float64": -1022}
# A mean difference below this many ulps never fails: pooled over a campaign
# (per output and dtype), and on one case. ua_kernels' bfloat16 out reaches
# -0.27 ulp on single cases whose logits saturate a cap (a few distinct
# probabilities, each rounded one way), -0.021 pooled over 69 ci cases;
# rounding toward zero gives -0.42 to -0.5 against the reference (docs/TOLERANCES.md, "Bias").
BIAS_FLOOR_ULPS = 0.1
CASE_BIAS_FLOOR_ULPS = 0.35
# Elements whose same-precision reference is further than this from the oracle
# are not measured (signed_ulps): the reference's rounding is no baseline there.
REFERENCE_WITHIN_ULPS = 1.0
# Differences within this many ulps count as none, of neither sign.
DEAD_ZONE_ULPS = 2.0 ** -6
# Judged: outputs returned in 16-bit dtypes, whose error is the final rounding
# (to nearest, by the contract's dtype rules) plus a far smaller float32
# accumulation; float32 outputs and lse are all accumulation, biased by the
# algorithm in either direction (the float32 reference's dk by 17 ulps on a ci
# case), and are recorded, not judged.
JUDGED_DTYPES = ("bfloat16", "float16")
# The family-wise false-alarm rate of one verdict (a case's outputs, or a
# campaign's outputs x dtypes).
BIAS_ALPHA = 1e-6


def output_dtype(name: str, dtype: str) -> str:
  """The dtype an output is returned in: lse and d sinks are float32 (float64
  for float64 inputs)."""
  return ("float64" if dtype == "float64" else "float32") if name in ("lse", "dsinks") \
      else dtype


def signed_ulps(got, oracle, dtype: str, reference=None) -> np.ndarray:
  """(got - reference) * sign(oracle) in ulps of ``dtype`` at |oracle| (the
  reference defaults to the oracle), in the oracle's shape; NaN where an
  element is not measured: the oracle not finite or rounding to zero in
  ``dtype`` (|oracle| at most half its smallest subnormal), the others not
  finite, or the reference more than REFERENCE_WITHIN_ULPS from the oracle.
  The ulp is a power of two from the oracle's exponent (frexp: exact, where a
  rounded log2 puts a value just below a power of two in the binade above)."""
  with np.errstate(invalid="ignore"):
    return _signed_ulps(np, got, oracle, oracle if reference is None else reference,
                        _MIN_EXPONENT[dtype], _SIGNIFICAND[dtype])


def _signed_ulps(xp, got, oracle, reference, min_exponent, significand):
  oracle = reductions.float64(xp, oracle)
  got = reductions.float64(xp, got).reshape(oracle.shape)
  reference = reductions.float64(xp, reference).reshape(oracle.shape)
  keep = xp.isfinite(oracle) & (oracle != 0) & xp.isfinite(got) & xp.isfinite(reference)
  exponent = xp.maximum(xp.frexp(xp.abs(oracle))[1] - 1, min_exponent)
  ulp = reductions.power_of_two(xp, exponent - significand)
  keep &= xp.abs(reference - oracle) <= REFERENCE_WITHIN_ULPS * ulp
  # An oracle that rounds to zero in the dtype (below half its smallest
  # subnormal: a saturated cap's exact derivative, 1e-136 on a whole dq row,
  # or float64 noise on an exact 0) leaves a kernel nothing to round: counted,
  # its difference of 0 diluted the mean under the floor (issue 61).
  keep &= xp.abs(oracle) > 0.5 * reductions.power_of_two(xp, min_exponent - significand)
  return xp.where(keep, (got - reference) * xp.sign(oracle) / ulp, xp.nan)


def stats(got, oracle, dtype: str, reference) -> "BiasStats":
  """BiasStats.of(signed_ulps(got, oracle, dtype, reference)), reduced on the
  device for a large output (reductions.reduce)."""
  return BiasStats(*reductions.reduce(_stats_terms, got, oracle, reference,
                                      _MIN_EXPONENT[dtype], _SIGNIFICAND[dtype]))


def _stats_terms(xp, got, oracle, reference, min_exponent, significand):
  return _counts(xp, _signed_ulps(xp, got, oracle, reference, min_exponent, significand))


def _counts(xp, ulps):
  """BiasStats' fields of ``ulps`` in ``xp`` (BiasStats.of says what they count)."""
  rows = ulps.reshape(-1, ulps.shape[-1]) if ulps.ndim >= 2 else ulps.reshape(-1, 1)
  measured = xp.isfinite(rows)
  clipped = xp.where(measured, xp.clip(rows, -1.0, 1.0), 0.0)
  counts = xp.sum(measured, axis=1)
  row_mean = xp.where(counts > 0, xp.sum(clipped, axis=1) / xp.maximum(counts, 1), 0.0)
  return (xp.sum(measured), xp.sum(measured & (rows > DEAD_ZONE_ULPS)),
          xp.sum(measured & (rows < -DEAD_ZONE_ULPS)), xp.sum(clipped), xp.sum(clipped ** 2),
          xp.sum(row_mean > DEAD_ZONE_ULPS), xp.sum(row_mean < -DEAD_ZONE_ULPS))


@dataclasses.dataclass
class BiasStats:
  """Signed differences of one output (of a case, or pooled): how many
  elements were away from zero (``above``), toward it (``below``), the sum and
  sum of squares of the clipped differences in ulps, and how many rows (the
  elements along the last axis) were on the whole away from zero
  (``rows_above``) or toward it (``rows_below``). The sign test counts rows:
  the elements of a row share its row's factors (dq = ds * k on a row of one
  visible key, where ds cancels to float32 noise of one sign), and are not
  independent draws (docs/TOLERANCES.md, "Bias")."""

  n: int = 0
  above: int = 0
  below: int = 0
  total: float = 0.0
  squares: float = 0.0
  rows_above: int = 0
  rows_below: int = 0

  @classmethod
  def of(cls, ulps: np.ndarray) -> "BiasStats":
    """The counts of each sign beyond DEAD_ZONE_ULPS, of elements and of rows
    (a row's sign: that of its mean clipped difference; a 1-D ``ulps``: each
    element a row), and the sums of the differences clipped to one ulp (one
    element of a cancelling sum must not outweigh thousands); NaN elements are
    not measured."""
    with np.errstate(invalid="ignore"):
      return cls(*(np.asarray(x).item() for x in _counts(np, np.asarray(ulps, np.float64))))

  def __add__(self, other: "BiasStats") -> "BiasStats":
    return BiasStats(*(a + b for a, b in zip(dataclasses.astuple(self),
                                             dataclasses.astuple(other))))

  @property
  def mean(self) -> float:
    return self.total / self.n if self.n else 0.0

  def p_value(self) -> float:
    """Two-sided sign test over rows: as many rows above zero as below."""
    from scipy.stats import binomtest
    signed = self.rows_above + self.rows_below
    return 1.0 if signed == 0 else float(binomtest(self.rows_below, signed, 0.5).pvalue)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def holm(p: dict[str, float]) -> dict[str, float]:
  """Holm's step-down adjustment of the p-values ``p`` (a family-wise rate)."""
  order = sorted(p, key=p.get)
  adjusted, running = {}, 0.0
  for rank, name in enumerate(order):
    running = max(running, min(1.0, (len(order) - rank) * p[name]))
    adjusted[name] = running
  return adjusted


def verdicts(stats: dict[str, BiasStats], alpha: float = BIAS_ALPHA,
             floor: float = BIAS_FLOOR_ULPS) -> dict[str, dict]:
  """Per name: the sign test's p-value, Holm-adjusted over ``stats``, the mean
  signed error, and ``biased``: significant at ``alpha`` and a mean of at
  least ``floor`` ulps."""
  adjusted = holm({name: s.p_value() for name, s in stats.items()})
  return {name: {"p_holm": adjusted[name], "mean_ulps": s.mean, "n": s.n,
                 "below": s.below, "above": s.above, "rows_below": s.rows_below,
                 "rows_above": s.rows_above,
                 "biased": adjusted[name] < alpha and abs(s.mean) >= floor}
          for name, s in stats.items()}
