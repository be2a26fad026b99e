"""Bias: a systematic shift of an output's rounding, which a max-abs bound
cannot see (round-toward-zero stays within one ulp of every element, inside
the bound, and moves every element the same way; a biased gradient is what
training accumulates).

Each element's error against the float64 oracle is projected on the oracle's
sign and measured in ulps of the output's dtype (at the oracle's magnitude):
negative is toward zero, positive away from it. A correct kernel rounds to
nearest, so its signed errors are as often negative as positive; the sign test
(scipy.stats.binomtest on the counts of each sign) finds a shift, and an
effect floor on the mean signed error keeps a shift too small to matter
(BIAS_FLOOR_ULPS) from failing, however many elements show it. Holm's
correction spans the outputs of one verdict. docs/TOLERANCES.md, "Bias".
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Significand bits and smallest normal exponent of the output dtypes.
_SIGNIFICAND = {"float32": 23, "bfloat16": 7, "float16": 10, "float64": 52}
_MIN_EXPONENT = {"float32": -126, "bfloat16": -126, "float16": -14, "float64": -1022}
# A mean signed error below this many ulps never fails (docs/TOLERANCES.md, "Bias").
BIAS_FLOOR_ULPS = 0.1
# Errors within this many ulps count as exact, of neither sign: where the
# result is exactly 0 or an input value (a row of one visible key), the
# oracle's float64 rounding noise (1e-16) gives the implementation's exact
# answer a sign, the same one on every such element.
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
  """The dtype an output is returned in: lse is float32 (float64 for float64 inputs)."""
  return ("float64" if dtype == "float64" else "float32") if name == "lse" else dtype


def signed_ulps(got, oracle, dtype: str) -> np.ndarray:
  """(got - oracle) * sign(oracle) in ulps of ``dtype`` at |oracle|, over the
  elements where the oracle is finite and nonzero and ``got`` finite."""
  got = np.asarray(got, np.float64).ravel()
  oracle = np.asarray(oracle, np.float64).ravel()
  keep = np.isfinite(oracle) & (oracle != 0) & np.isfinite(got)
  got, oracle = got[keep], oracle[keep]
  exponent = np.maximum(np.floor(np.log2(np.abs(oracle))), _MIN_EXPONENT[dtype])
  ulp = np.exp2(exponent - _SIGNIFICAND[dtype])
  return (got - oracle) * np.sign(oracle) / ulp


@dataclasses.dataclass
class BiasStats:
  """Signed errors of one output (of a case, or pooled): how many were away
  from zero (``above``), toward it (``below``), and their sum and sum of
  squares in ulps."""

  n: int = 0
  above: int = 0
  below: int = 0
  total: float = 0.0
  squares: float = 0.0

  @classmethod
  def of(cls, ulps: np.ndarray) -> "BiasStats":
    return cls(int(ulps.size), int((ulps > DEAD_ZONE_ULPS).sum()),
               int((ulps < -DEAD_ZONE_ULPS).sum()), float(ulps.sum()),
               float(np.square(ulps).sum()))

  def __add__(self, other: "BiasStats") -> "BiasStats":
    return BiasStats(*(a + b for a, b in zip(dataclasses.astuple(self),
                                             dataclasses.astuple(other))))

  @property
  def mean(self) -> float:
    return self.total / self.n if self.n else 0.0

  def p_value(self) -> float:
    """Two-sided sign test: as many errors above zero as below."""
    from scipy.stats import binomtest
    signed = self.above + self.below
    return 1.0 if signed == 0 else float(binomtest(self.below, signed, 0.5).pvalue)

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def verdicts(stats: dict[str, BiasStats], alpha: float = BIAS_ALPHA,
             floor: float = BIAS_FLOOR_ULPS) -> dict[str, dict]:
  """Per name: the sign test's p-value, Holm-adjusted over ``stats``, the mean
  signed error, and ``biased``: significant at ``alpha`` and a mean of at
  least ``floor`` ulps."""
  p = {name: s.p_value() for name, s in stats.items()}
  order = sorted(p, key=p.get)
  adjusted, running = {}, 0.0
  for rank, name in enumerate(order):
    running = max(running, min(1.0, (len(order) - rank) * p[name]))
    adjusted[name] = running
  return {name: {"p_holm": adjusted[name], "mean_ulps": s.mean, "n": s.n,
                 "below": s.below, "above": s.above,
                 "biased": adjusted[name] < alpha and abs(s.mean) >= floor}
          for name, s in stats.items()}
