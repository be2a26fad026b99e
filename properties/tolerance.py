"""Tolerance model: how close an implementation must be to the float64 oracle.

For each output X in (out, lse, dq, dk, dv) of a case:
    err_impl = max |X_impl - X_oracle|      err_ref = max |X_ref - X_oracle|
where X_oracle is ua_reference in float64 and X_ref is ua_reference run on the
same-precision inputs (its natural precision for that dtype). The case passes iff
    err_impl <= ALPHA[X] * err_ref + floor[X],
floor[X] = FLOOR[dtype] * max(max |X_oracle|, a bound on the terms summed into
X), plus for lse 4 float32 ulps of the logits' products (logit_terms), and for
gradients LOGIT_EPS * max |lse| * terms: gradients can cancel
to ~0 (T = 1 gives dq = dk = 0 exactly) while a kernel still rounds terms of
size |dO||V|, and a kernel that recomputes logits in the backward sees them
one ulp away from the forward's, which a reference computing them once does not.
ALPHA scales with how much more rounding a fused kernel does than the reference
(16-bit probabilities and ds tiles in the matmuls); FLOOR covers cases whose
reference happens to round almost exactly. Both come from data: see
scripts in properties/calibrate.py and docs/TOLERANCES.md. NaN/inf are checked
separately and always fail (lse = -inf only where the oracle has -inf).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

OUTPUTS = ("out", "lse", "dq", "dk", "dv")

# Calibrated in docs/TOLERANCES.md (properties/calibrate.py).
ALPHA = {"out": 4.0, "lse": 4.0, "dq": 8.0, "dk": 8.0, "dv": 8.0}
FLOOR = {"float32": 4 * 2.0 ** -23, "bfloat16": 2 * 2.0 ** -8, "float16": 2 * 2.0 ** -10,
         "float64": 4 * 2.0 ** -52}
LOGIT_EPS = 2.0 ** -22


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

  @property
  def ratio(self) -> float:
    if self.nan_count or self.inf_mismatch:
      return float("inf")
    if self.tolerance == 0:
      return 0.0 if self.max_abs_err == 0 else float("inf")
    return self.max_abs_err / self.tolerance

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


def tolerance(name: str, ref_err: float, floor: float) -> float:
  return ALPHA[name] * ref_err + floor


def _absmax(x) -> float:
  x = _as64(x)
  return float(np.max(np.abs(np.where(np.isfinite(x), x, 0.0)), initial=0.0))


def floors(case, inputs: dict, oracle: dict, lse_max: float) -> dict[str, float]:
  """Absolute rounding floor per output (see the module doc and TOLERANCES.md).

  ``terms``: bounds on the terms each output sums; ds = p * (dp - delta) *
  temperature * cap' * sm_scale with |cap'| <= 1, dp = dO.V bounded by row
  norms, delta holding dlse and w * lse. Gradients also get LOGIT_EPS * lse_max
  (max |lse| of the oracle): the backward recomputes the logits that matter
  (those within a few units of their row's lse), and a one-ulp difference from
  the forward's makes p off by that relative amount.
  """
  dlse = _absmax(inputs["dlse"]) if case.return_lse else 0.0
  dp = _row_norm(inputs["dout"]) * _row_norm(inputs["v"])
  ds = _logit_scale(case, inputs) * (2 * dp + dlse + case.z_loss_weight * lse_max)
  terms = {"out": _absmax(inputs["v"]), "lse": 1.0, "dv": _absmax(inputs["dout"]),
           "dq": ds * _absmax(inputs["k"]), "dk": ds * _absmax(inputs["q"])}
  out = {}
  for name, term in terms.items():
    if oracle.get(name) is None:
      continue
    scale = max(_absmax(oracle[name]), term)
    recompute = LOGIT_EPS * lse_max * term if name in ("dq", "dk", "dv") else 0.0
    out[name] = FLOOR[case.dtype] * scale + recompute
  if "lse" in out:
    out["lse"] += FLOOR["float32"] * logit_terms(case, inputs)
  return out


def logit_terms(case, inputs: dict) -> float:
  """A bound on the sum of |products| behind one logit, |temperature| * |sm_scale|
  * sum_d |q_d k_d| <= |temperature| * |sm_scale| * max ||q_i|| * max ||k_j|| (a
  cap's slope is at most 1). The logits are float32 dot products for every
  input dtype, and their rounding error scales with this sum, not with the
  logit: when the products cancel, a logit of 12 built of products near 100
  is off by ulps of 100. lse moves by at most the logits' error; FLOOR["float32"]
  (4 ulps) of this sum is below the probabilistic bound of a D-term dot,
  sqrt(D) * u * sum |q_d k_d| (Higham & Mary 2019), for D >= 16.
  docs/TOLERANCES.md, "lse floor"."""
  return _logit_scale(case, inputs) * _row_norm(inputs["q"]) * _row_norm(inputs["k"])


def _row_norm(x) -> float:
  """The largest Euclidean norm of a row (the last axis) of x."""
  return float(np.max(np.linalg.norm(_as64(x), axis=-1), initial=0.0))


def _logit_scale(case, inputs: dict) -> float:
  """|temperature| * |sm_scale|: what multiplies q.k into a logit, at most."""
  sm = abs(case.sm_scale if case.sm_scale is not None else case.head_dim ** -0.5)
  temp = 1.0 if inputs["temperature"] is None else _absmax(inputs["temperature"])
  return temp * sm


def reference_error(ref, oracle) -> float:
  """max |ref - oracle| over the oracle's finite entries."""
  ref, oracle = _as64(ref), _as64(oracle)
  finite = np.isfinite(oracle)
  return float(np.max(np.where(finite & np.isfinite(ref), np.abs(ref - oracle), 0.0),
                      initial=0.0))


def compare(name: str, impl, expected, ref_err: float, floor: float, *,
            slack: float = 1.0, label: str | None = None) -> OutputError:
  """Scores one output against ``expected`` (the oracle, or for metamorphic
  properties another result of the same implementation, with ``slack`` 2 by
  the triangle inequality). ``label`` names a slice of the output in reports.

  A value beyond the output dtype's range rounds to inf: there, inf of the
  right sign is the correct answer (16-bit gradients overflow legitimately).
  """
  limit = float(jnp.finfo(np.asarray(impl).dtype).max)
  impl, expected = _as64(impl), _as64(expected)
  if impl.shape != expected.shape:
    raise AssertionError(f"{name}: shape {impl.shape} != expected {expected.shape}")
  tol = slack * tolerance(name, ref_err, floor)
  finite = np.isfinite(expected)
  overflow = finite & (np.abs(expected) + tol >= limit) & np.isinf(impl) & \
      (np.sign(impl) == np.sign(expected))
  nan_count = int(np.isnan(impl).sum())
  # Non-finite where a finite value is expected (and not a correct overflow),
  # or not exactly the expected -inf (lse of a row with no visible key).
  inf_mismatch = int((np.isinf(impl) & finite & ~overflow).sum()
                     + (~finite & ~np.isnan(impl) & (impl != expected)).sum())
  diff = np.where(finite & np.isfinite(impl), np.abs(impl - expected), 0.0)
  worst = np.unravel_index(int(np.argmax(diff)), diff.shape) if diff.size else ()
  return OutputError(label or name, float(np.max(diff, initial=0.0)), ref_err, tol,
                     nan_count, inf_mismatch, tuple(int(i) for i in worst))


def error_table(errors: list[OutputError]) -> str:
  lines = [f"{'output':6} {'max_abs_err':>12} {'tolerance':>12} {'ratio':>9} "
           f"{'NaN':>5} {'inf!':>5}  worst index"]
  for e in errors:
    lines.append(f"{e.name:6} {e.max_abs_err:12.4e} {e.tolerance:12.4e} {e.ratio:9.3f} "
                 f"{e.nan_count:5d} {e.inf_mismatch:5d}  {e.worst_index}")
  return "\n".join(lines)
