"""Tolerance model: how close an implementation must be to the float64 oracle.

For each element e of each output X in (out, lse, dq, dk, dv) of a case:
    err_impl[e] = |X_impl[e] - X_oracle[e]|      err_ref = max |X_ref - X_oracle|
where X_oracle is ua_reference in float64 and X_ref is ua_reference run on the
same-precision inputs (its natural precision for that dtype). The case passes iff
    err_impl[e] <= floor[X][e] * (1 + ALPHA[X] * rho)   for every e,
rho = max_e |X_ref[e] - X_oracle[e]| / floor[X][e] (the reference's error in
units of the floor, element_tolerance), and
floor[X][e] = FLOOR[dtype] * max(|X_oracle[e]|, the sum of the absolute values of
the terms e sums) plus the logits' rounding carried through those sums
(floors, properties.judge.error_terms): an element whose terms cancel keeps their
allowance, and every other element gets one of its own size. The logits' error
counts one rounding of each logit and row lse (RECOMPUTE_EPS): a kernel that
recomputes p in the backward sees them one ulp away from its forward's, which
a reference computing p once does not. ALPHA scales with how much more
rounding a fused kernel does than the reference (16-bit probabilities and ds
tiles in the matmuls); FLOOR covers cases whose reference happens to round
almost exactly. Both come from data: see properties/judge/calibrate.py and
docs/TOLERANCES.md. NaN/inf are checked separately and always fail (lse = -inf
only where the oracle has -inf).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from . import error_terms, reductions

OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dsinks")

# Calibrated in docs/TOLERANCES.md (properties/judge/calibrate.py); FLOOR is two unit
# roundoffs of a 16-bit dtype and four of float32's ("Tighter floors" there).
ALPHA = {"out": 4.0, "lse": 4.0, "dq": 4.0, "dk": 4.0, "dv": 4.0, "dsinks": 4.0}
FLOOR = {"float32": 4 * 2.0 ** -24, "bfloat16": 2 * 2.0 ** -8, "float16": 2 * 2.0 ** -11,
         "float64": 4 * 2.0 ** -52}
# An absolute floor per element: what a float32 kernel that flushes subnormal
# intermediates (below 2^-126) loses over up to 2^26 terms (and bfloat16 has
# float32's range); float16 outputs are rounded to its subnormal spacing, 2^-24,
# below its normal range (its probabilities and ds: SUBNORMAL_ROUNDING). Without it a
# value of 1e-44 that float32 flushes to 0 is "off by 5000 floors"
# (docs/TOLERANCES.md, "Per-element floors").
UNDERFLOW = {"float32": 2.0 ** -100, "bfloat16": 2.0 ** -100, "float16": 2.0 ** -24,
             "float64": 2.0 ** -1000}
# Below the input dtype's normal range a probability or a ds is rounded to
# float16's subnormal spacing, 2^-24 (an absolute rounding), or, on a GPU, flushed
# to zero below float32's, 2^-126 (bfloat16 has float32's range): a flushed p
# loses at most itself, min(p, 2^-126), carried through |dp - delta| + D into dq
# and dk. With |v| ~ 5e18 a key whose p of 3e-39 was flushed left dk off by
# 1.9e-19 against a floor of 8.6e-22 on the H200 (docs/TOLERANCES.md,
# "Per-element floors").
SUBNORMAL_ROUNDING = {"float16": 2.0 ** -24}
FLUSH_BELOW = {"float32": 2.0 ** -126, "bfloat16": 2.0 ** -126}
# A logit recomputed in a backward, one float32 ulp of it and of lse (2u) away
# from the forward's (docs/TOLERANCES.md: a row of one key at |z| = 254 had
# p = 1 +- 2e-5, 0.66u of |z| + |lse|; "Tighter floors").
RECOMPUTE_EPS = 2.0 ** -23
# Max |form - exact| of an implementation's own cap form beyond the exact form's
# float32 error, relative to the largest cap parameter (forward) or absolute
# (derivative, within [0, 1]): float16's rounding, 2^-11, with a factor 2 for
# the derivative's 2t * dt. properties/checks/cap_checks.py holds declared forms to it;
# the floors of 16-bit capped cases allow it to any implementation.
FORM_TOLERANCE = 2.0 ** -10


@dataclasses.dataclass
class OutputError:
  name: str
  max_abs_err: float
  ref_err: float
  tolerance: float
  nan_count: int
  inf_mismatch: int
  worst_index: tuple[int, ...]
  bias: dict | None = None  # bias.BiasStats of the signed errors, where measured against the oracle
  # The error at worst_index, the element of the largest error/tolerance, whose
  # tolerance ``tolerance`` is (None: max_abs_err, for one tolerance for all).
  error: float | None = None

  @property
  def ratio(self) -> float:
    if self.nan_count or self.inf_mismatch:
      return float("inf")
    error = self.max_abs_err if self.error is None else self.error
    if self.tolerance == 0:
      return 0.0 if error == 0 else float("inf")
    return error / self.tolerance

  @property
  def ok(self) -> bool:
    return self.ratio <= 1.0

  def to_dict(self):
    d = dataclasses.asdict(self)
    d["ratio"] = self.ratio
    d["worst_index"] = list(self.worst_index)
    return d


def _as64(x):
  return np.asarray(np.asarray(x).astype(np.float64))


def element_tolerance(name: str, ref, oracle, floor) -> tuple[float, np.ndarray]:
  """(err_ref, the tolerance of every element): ``floor * (1 + ALPHA * rho)``,
  rho the same-precision reference's largest error in units of the floor
  (over elements with a floor), so that every element is allowed ALPHA times
  what the reference needed at its worst, in its own units; plus ALPHA times
  the reference's error where the floor is 0 (no terms: nothing to round).
  Large outputs are reduced on the device (properties.judge.reductions)."""
  err_ref, rho, unfloored = reductions.reduce(_tolerance_terms, ref, oracle, floor)
  tolerance = np.multiply(np.broadcast_to(np.asarray(floor, np.float64), np.shape(oracle)),
                          1.0 + ALPHA[name] * rho)
  if unfloored:
    tolerance += ALPHA[name] * unfloored
  return err_ref, tolerance


def _tolerance_terms(xp, ref, oracle, floor):
  """(the reference's largest error, its largest error in units of the floor,
  its largest error where the floor is 0), in ``xp`` (reductions.reduce)."""
  ref, oracle = reductions.float64(xp, ref), reductions.float64(xp, oracle)
  finite = xp.isfinite(oracle) & xp.isfinite(ref)
  err = xp.where(finite, xp.abs(ref - oracle), 0.0)
  floor = xp.broadcast_to(reductions.float64(xp, floor), err.shape)
  rho = xp.max(xp.where(floor > 0, err / floor, 0.0), initial=0.0)
  unfloored = xp.max(xp.where(floor > 0, 0.0, err), initial=0.0)
  return xp.max(err, initial=0.0), rho, unfloored


def floors(case, inputs: dict, oracle: dict, lse, rows=None) -> dict[str, np.ndarray]:
  """Absolute rounding floor of every element of every output (the module doc;
  docs/TOLERANCES.md, "Per-element floors").

  out, dq, dk, dv: FLOOR[dtype] times the larger of the element's oracle value
  and the sum of the absolute values of its terms (properties.judge.error_terms),
  plus the logits' own rounding carried through the same sums, plus
  UNDERFLOW[dtype]. lse: FLOOR[float32] of max(|lse|, 1) and the logits'
  rounding, for every input dtype: lse is a float32 output of the contract, so
  a kernel that sums 16-bit rounded probabilities into its row sum is held to
  float32's accuracy like any other (docs/TOLERANCES.md, "Tighter floors").
  ``lse``: the oracle's [B, Hq, T] lse; ``rows``: the query rows judged
  (sampled.py; None: all), of which ``lse`` and the oracle's row outputs are.
  """
  lse = _as64(lse)
  rounding = error_terms.Rounding(
      logit=FLOOR["float32"], recompute=RECOMPUTE_EPS,
      form=FORM_TOLERANCE if case.dtype in ("bfloat16", "float16")
      and case.cap_method != "none" else 0.0,
      subnormal=SUBNORMAL_ROUNDING.get(case.dtype, 0.0), flush=FLUSH_BELOW.get(case.dtype, 0.0))
  sums, logit = error_terms.element_terms(case, inputs, lse, rounding, rows=rows)
  out = {}
  for name, term in sums.items():
    if oracle.get(name) is None:
      continue
    floor = np.array(oracle[name], np.float64)  # a copy, in place from here: T=16k
    np.abs(floor, out=floor)                     # outputs are 10^8 bytes
    np.maximum(floor, term, out=floor)
    floor *= FLOOR[case.dtype]
    floor += logit[name]
    floor += UNDERFLOW[case.dtype]
    out[name] = floor
  if oracle.get("lse") is not None:
    finite = np.where(np.isfinite(lse), np.abs(lse), 0.0)
    out["lse"] = FLOOR["float32"] * np.maximum(finite, 1.0) + logit["lse"]
  return out


def compare(name: str, impl, expected, ref_err: float, tolerance, *,
            slack: float = 1.0, label: str | None = None) -> OutputError:
  """Scores one output against ``expected`` (the oracle, or for metamorphic
  properties another result of the same implementation, with ``slack`` 2 by
  the triangle inequality). ``tolerance``: a scalar or an array of the
  output's shape (element_tolerance), times ``slack``; the verdict is the
  largest error/tolerance over the elements, and the report names that
  element. ``ref_err`` is reported. ``label`` names a slice of the output in
  reports.

  A value beyond the output dtype's range rounds to inf: there, inf of the
  right sign is the correct answer (16-bit gradients overflow legitimately).
  """
  limit = float(jnp.finfo(impl.dtype if hasattr(impl, "dtype") else np.asarray(impl).dtype).max)
  if np.shape(impl) != np.shape(expected):
    raise AssertionError(f"{name}: shape {np.shape(impl)} != expected {np.shape(expected)}")
  max_err, nan_count, inf_mismatch, worst, error, tol = reductions.reduce(
      _compare_terms, impl, expected, tolerance, slack, limit)
  worst = np.unravel_index(worst, np.shape(expected)) if np.size(expected) else ()
  return OutputError(label or name, max_err, ref_err, tol, nan_count, inf_mismatch,
                     tuple(int(i) for i in worst), error=error)


def _compare_terms(xp, impl, expected, tolerance, slack, limit):
  """compare's reductions in ``xp`` (reductions.reduce): (largest error, NaN
  count, non-finite mismatches, flat index of the largest error/tolerance, the
  error and the tolerance there)."""
  impl, expected = reductions.float64(xp, impl), reductions.float64(xp, expected)
  tol = reductions.materialized(
      xp, xp.broadcast_to(slack * reductions.float64(xp, tolerance), expected.shape))
  finite = xp.isfinite(expected)
  overflow = finite & (xp.abs(expected) + tol >= limit) & xp.isinf(impl) & \
      (xp.sign(impl) == xp.sign(expected))
  nan_count = xp.sum(xp.isnan(impl))
  # Non-finite where a finite value is expected (and not a correct overflow),
  # or not exactly the expected -inf (lse of a row with no visible key).
  inf_mismatch = (xp.sum(xp.isinf(impl) & finite & ~overflow)
                  + xp.sum(~finite & ~xp.isnan(impl) & (impl != expected)))
  diff = xp.where(finite & xp.isfinite(impl), xp.abs(impl - expected), 0.0)
  if not diff.size:
    return 0.0, nan_count, inf_mismatch, 0, 0.0, 0.0
  ratio = xp.where(diff == 0, 0.0, diff / tol).reshape(-1)
  worst = reductions.first_argmax(xp, ratio)
  return (xp.max(diff), nan_count, inf_mismatch, worst, diff.reshape(-1)[worst],
          tol.reshape(-1)[worst])


def error_table(errors: list[OutputError]) -> str:
  """Per output: the error and the tolerance at the element of the largest
  error/tolerance (worst index), their ratio, and the largest error anywhere."""
  lines = [f"{'output':6} {'error':>12} {'tolerance':>12} {'ratio':>9} {'max_abs_err':>12} "
           f"{'NaN':>5} {'inf!':>5}  worst index"]
  for e in errors:
    error = e.max_abs_err if e.error is None else e.error
    lines.append(f"{e.name:6} {error:12.4e} {e.tolerance:12.4e} {e.ratio:9.3f} "
                 f"{e.max_abs_err:12.4e} {e.nan_count:5d} {e.inf_mismatch:5d}  {e.worst_index}")
  return "\n".join(lines)
