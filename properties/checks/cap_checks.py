"""Checks of one registered cap method, before any attention case runs.

A cap method is a forward, a hand-written derivative and optional declarations
(ua_reference.caps). Each check below raises CapCheckFailure naming the method,
its parameters and the x where the declaration and the function disagree:

- the derivative equals autodiff of the forward (float64);
- declared ``bounds`` contain every output (up to a few roundings) and are
  reached towards +-inf (at +-1e300);
- declared ``homogeneous``: a*cap(x/a; p/a) = cap(x; p), derivatives likewise;
- an implementation's own forms (``ua_cap_forms``) are within FORM_TOLERANCE.

tests/test_cap_methods.py runs them on every registered method; ``ua-fuzz
--cap NAME`` runs them on NAME first, so a wrong derivative is named as such
instead of surfacing as dq/dk errors of attention cases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ua_reference.caps import CAP_METHODS, CapMethod

from ..judge.runner import x64
from ..judge.tolerance import FORM_TOLERANCE


class CapCheckFailure(AssertionError):
  pass


def _fail(method: CapMethod, params, what: str, x=None, detail: str = ""):
  at = "" if x is None else f" at x = {x!r}"
  raise CapCheckFailure(f"cap method {method.name!r} with params {tuple(params)}: {what}{at}"
                        + (f"; {detail}" if detail else ""))


# The checks evaluate their points in arrays whose length is a multiple of BUCKET (the first
# point repeated): a search of hundreds of draws of every length then compiles each jnp
# operation a few times rather than once per length (tens of milliseconds a compile on CI's CPU).
BUCKET = 64


def _padded(xs, dtype) -> tuple[jax.Array, int]:
  """(xs as a jnp array of ``dtype`` padded to a multiple of BUCKET, len(xs))."""
  xs = np.asarray(xs, np.float64)
  n = xs.size
  fill = np.full(-n % BUCKET, xs[0] if n else 0.0)
  return jnp.asarray(np.concatenate([xs, fill]), dtype), n


def _at(values, n: int) -> np.ndarray:
  """An elementwise function's values at the padded points, back at the n drawn ones."""
  return np.asarray(values)[:n]


def _worst(xs, bad):
  """The x of the worst disagreement (bad: array of excess per point, NaN
  the worst: argmax alone would name the first NaN's neighbour or any point)."""
  bad = np.where(np.isnan(bad), np.inf, bad)
  return float(np.asarray(xs)[int(np.argmax(bad))])


def check_derivative(method: CapMethod, params, xs) -> None:
  with x64(True):
    x, n = _padded(xs, jnp.float64)
    auto = _at(jax.vmap(jax.grad(lambda s: method.forward(s, *params)))(x), n)
    hand = _at(method.grad(x, *params), n)
    fwd = _at(method.forward(x, *params), n)
  if not (np.isfinite(fwd).all() and np.isfinite(hand).all()):
    bad = ~(np.isfinite(fwd) & np.isfinite(hand))
    _fail(method, params, "non-finite forward or derivative", _worst(xs, bad))
  excess = np.abs(hand - auto) - (1e-10 * np.abs(auto) + 1e-12)
  if (excess > 0).any():
    i = int(np.argmax(excess))
    _fail(method, params, "the hand-written derivative differs from autodiff of the forward",
          float(xs[i]), f"grad = {hand[i]!r}, autodiff = {auto[i]!r}")


# Far ends of the logit axis at which declared bounds must be reached. The
# limits at -inf/+inf, not the values there: the kernels never cap an infinite
# logit (masks apply after the cap), and a formula such as c*x/(c+|x|) is
# inf/inf = NaN at x = inf although its limit is c.
BOUND_ENDS = (-1e300, 1e300)
# An output may pass a bound by this many float64 roundings of the bound (c*x/(c+|x|)
# at x = 1e30 rounds to c*(1 + 2^-52)).
BOUND_ULPS = 4


def check_bounds(method: CapMethod, params, xs) -> None:
  if method.bounds is None:
    return
  lo, hi = method.bounds(*params)
  points = np.concatenate([np.asarray(xs, np.float64), [-1e30, 1e30], BOUND_ENDS])
  with x64(True):
    x, n = _padded(points, jnp.float64)
    out = _at(method.forward(x, *params), n)
  if not np.isfinite(out).all():
    bad = ~np.isfinite(out)
    _fail(method, params, "non-finite output", _worst(points, bad.astype(float)),
          f"output {out[int(np.argmax(bad))]!r}")
  slack = BOUND_ULPS * np.finfo(np.float64).eps * max(abs(lo), abs(hi))
  outside = np.maximum(lo - out, out - hi) - slack
  if (outside > 0).any():
    _fail(method, params, f"an output lies outside the declared bounds ({lo}, {hi})",
          _worst(points, outside), f"output {out[int(np.argmax(outside))]!r}")
  if not np.allclose(out[-2:], [lo, hi], rtol=1e-12):
    _fail(method, params, f"the declared bounds ({lo}, {hi}) are not reached at "
          f"x = {BOUND_ENDS}", detail=f"outputs {out[-2:].tolist()}")


# Points below this magnitude are left out of the homogeneity comparison:
# XLA:CPU flushes float64 subnormals to zero, so x/a and its products with
# p/a can vanish there on one side of the identity and not on the other.
HOMOGENEOUS_MIN_X = 1e-250


def check_homogeneous(method: CapMethod, params, xs, a: float) -> None:
  if not method.homogeneous:
    return
  xs = np.asarray(xs, np.float64)
  xs = xs[np.abs(xs) >= HOMOGENEOUS_MIN_X]
  if xs.size == 0:
    return
  with x64(True):
    x, n = _padded(xs, jnp.float64)
    scaled = tuple(c / a for c in params)
    lhs = _at(a * method.forward(x / a, *scaled), n)
    rhs = _at(method.forward(x, *params), n)
    glhs = _at(method.grad(x / a, *scaled), n)
    grhs = _at(method.grad(x, *params), n)
  excess = np.abs(lhs - rhs) - (1e-12 * np.abs(rhs) + 1e-300)
  if (excess > 0).any():
    _fail(method, params, f"declared homogeneous, but a*cap(x/a; p/a) != cap(x; p) for a = {a}",
          _worst(xs, excess))
  # Derivative steps (the hard cap's) sit at |x| = a parameter; x/a may cross them.
  kink = np.isclose(np.abs(xs)[:, None], np.asarray(params)[None, :], rtol=1e-6).any(axis=1)
  excess = np.where(kink, 0.0, np.abs(glhs - grhs) - (1e-10 * np.abs(grhs) + 1e-12))
  if (excess > 0).any():
    _fail(method, params, f"declared homogeneous, but the derivative is not scale-free "
          f"(a = {a})", _worst(xs, excess))


def check_forms(method: CapMethod, forms, params, xs) -> None:
  """An implementation's own (forward, grad) of the method, evaluated in float32
  as a kernel would: |form - exact(float64)| may exceed the exact form's own
  float32 error by at most FORM_TOLERANCE (times the largest parameter for the
  forward)."""
  if forms is None:
    return
  with x64(True):
    (x64_, n), (x32, _) = _padded(xs, jnp.float64), _padded(xs, jnp.float32)
    err = lambda a, b: np.abs(_at(a, n).astype(np.float64) - _at(b, n).astype(np.float64))
    for label, form, exact, scale in (
        ("forward", forms[0], method.forward, max(params, default=1.0)),
        ("derivative", forms[1], method.grad, 1.0)):
      truth = exact(x64_, *params)
      value = form(x32, *params)
      if value.dtype != jnp.float32:
        _fail(method, params, f"the implementation's {label} form returns {value.dtype}, "
              "not float32")
      excess = err(value, truth) - err(exact(x32, *params), truth) - FORM_TOLERANCE * scale
      if (excess > 0).any():
        _fail(method, params, f"the implementation's {label} form is off by more than "
              f"{FORM_TOLERANCE} x {scale:g}", _worst(xs, excess))


_scales = st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False)


@st.composite
def cap_points(draw, names):
  """(method name, params, xs): wide x, with points on and beside each parameter."""
  name = draw(st.sampled_from(sorted(names)))
  params = tuple(draw(_scales) for _ in CAP_METHODS[name].param_names)
  xs = draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=64))
  for c in params:
    xs += [c, -c, c * (1 + 1e-9), -c * (1 + 1e-9), c * (1 - 1e-9)]
  return name, params, np.asarray(xs, np.float64)


def check_all(method: CapMethod, params, xs, forms=None, a: float = 3.7) -> None:
  check_derivative(method, params, xs)
  check_bounds(method, params, xs)
  check_homogeneous(method, params, xs, a)
  check_forms(method, forms, params, xs)


def precheck(name: str, forms=None, examples: int = 300) -> str | None:
  """Searches for a point where method ``name`` contradicts its declarations;
  returns the first contradiction found (as a message) or None."""
  method = CAP_METHODS[name]
  found = []

  @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
            phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
  @given(cap_points([name]), st.floats(1e-3, 1e3))
  def search(point, a):
    _, params, xs = point
    check_all(method, params, xs, forms, a)

  try:
    search()
  except CapCheckFailure as exc:
    found.append(str(exc))
  return found[0] if found else None
