"""The registry of logit-capping methods, part of the contract (docs/SEMANTICS.md).

A cap method maps the scaled logits ``s = sm_scale * <q, k>`` elementwise to
capped logits. Each method carries its forward and a hand-written derivative:
an implementation may use the derivative directly (the kernels do), the
reference differentiates the forward with autodiff, and the suite checks the
two against each other. Adding a method is one call to
:func:`register_cap_method`; the reference, the validation, the suite's
strategies and any implementation that reads this registry pick it up.

Every parameter of every method is a positive, finite scale (a cap in logit
units); validation rejects anything else, and the suite's strategies draw
parameters around the logits' magnitude so that the cap is actually reached.

Two optional declarations describe the function, and the suite checks both
(properties/cap_checks.py): ``homogeneous`` (cap(a*x; a*p) = a*cap(x; p) for
a > 0), which lets an implementation move the first parameter into a later
multiply, and ``bounds`` (the range of the outputs), which lets it shift its
exponentials by a constant instead of a running row max.

These are the exact forms. An implementation may evaluate a cap with its own
faster forms (ua_kernels registers approximate-tanh ones for bfloat16); it
declares them to the suite with ``ua_cap_forms`` (docs/PLUGINS.md).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

# The kernels compute in float32: a parameter must be a normal float32 there.
_F32_TINY, _F32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)

CapFn = Callable[..., jnp.ndarray]


@dataclasses.dataclass(frozen=True)
class CapMethod:
  """One registered cap: ``forward(x, *params)`` and its derivative
  ``grad(x, *params)``; ``homogeneous``: forward(a*x, *(a*p)) = a*forward(x, *p)
  for a > 0; ``bounds(*params) -> (lo, hi)``: the range of forward over all x
  (None: unbounded)."""

  name: str
  param_names: tuple[str, ...]
  forward: CapFn
  grad: CapFn
  doc: str = ""
  homogeneous: bool = False
  bounds: Callable[..., tuple[float, float]] | None = None

  def validate_params(self, params: Sequence[float]) -> tuple[float, ...]:
    """Returns params as floats, or raises naming ``cap_params``."""
    try:
      if isinstance(params, (str, bytes)):
        raise TypeError
      params = tuple(params)
    except TypeError:
      raise TypeError(
          f"cap_params must be a sequence of floats, got {params!r}") from None
    if len(params) != len(self.param_names):
      raise ValueError(
          f"cap_method {self.name!r} takes {len(self.param_names)} cap_params "
          f"{self.param_names}, got {len(params)}: {params!r}")
    out = []
    for pname, value in zip(self.param_names, params):
      if isinstance(value, (bool, np.bool_, str, bytes)):
        raise TypeError(
            f"cap_params[{pname}] of cap_method {self.name!r} must be a "
            f"static Python float, got {type(value).__name__}")
      if not isinstance(value, (int, float)):
        try:
          value = float(value)  # numpy / concrete jax scalars
        except Exception:
          raise TypeError(
              f"cap_params[{pname}] of cap_method {self.name!r} must be a "
              f"static Python float, got {type(value).__name__}") from None
      value = float(value)
      if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"cap_params[{pname}] of cap_method {self.name!r} must be a "
            f"positive finite float, got {value!r}")
      if not _F32_TINY <= value <= _F32_MAX:
        raise ValueError(
            f"cap_params[{pname}] of cap_method {self.name!r} must be a normal float32 "
            f"magnitude, in [{_F32_TINY:.3g}, {_F32_MAX:.3g}], got {value!r}")
      out.append(value)
    return tuple(out)


CAP_METHODS: dict[str, CapMethod] = {}


def register_cap_method(name: str, param_names: Sequence[str], forward: CapFn,
                        grad: CapFn, doc: str = "", *, homogeneous: bool = False,
                        bounds: Callable[..., tuple[float, float]] | None = None
                        ) -> CapMethod:
  """Registers a cap method; the reference and the suite pick it up with no other edit."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"cap method name must be a non-empty string, got {name!r}")
  if name in CAP_METHODS:
    raise ValueError(f"cap method {name!r} is already registered")
  if not callable(forward) or not callable(grad):
    raise TypeError(f"cap method {name!r}: forward and grad must be callables")
  if bounds is not None and not callable(bounds):
    raise TypeError(f"cap method {name!r}: bounds must be a callable(*params) -> (lo, hi)")
  method = CapMethod(name, tuple(param_names), forward, grad, doc, bool(homogeneous), bounds)
  CAP_METHODS[name] = method
  return method


def get_cap_method(name: str) -> CapMethod:
  if not isinstance(name, str):
    raise TypeError(f"cap_method must be a string, got {type(name).__name__}")
  try:
    return CAP_METHODS[name]
  except KeyError:
    raise ValueError(
        f"unknown cap_method {name!r}; registered: {sorted(CAP_METHODS)}"
    ) from None


def _one_minus_square(y, t):
  """1 - tanh(y)^2 as e (1 + |t|)^2 with e = exp(-2|y|): equal to
  4e / (1 + e)^2, since 1 + |tanh y| = 2 / (1 + e), and free of the
  cancellation of 1 - t^2, which near saturation (|y| past 4, t within 2^-11
  of 1) leaves the float32 derivative as wrong as t's last bits, one way on
  a whole saturated row (docs/DEFECTS.md, F61)."""
  e = jnp.exp(-2.0 * jnp.abs(y))
  s = 1.0 + jnp.abs(t)
  return e * (s * s)


def _tanh_family(tanh, complement=_one_minus_square):
  """(forward, derivative) of c*tanh(x/c) in terms of (x, c, 1/c): a multiply
  by a constant reciprocal, not a division per element. The derivative is
  ``complement(y, t)``, 1 - tanh(y)^2 given y = x/c and t = tanh(y)."""
  def forward(x, c, inv_c):
    return c * tanh(x * inv_c)

  def derivative(x, c, inv_c):
    y = x * inv_c
    return complement(y, tanh(y))

  return forward, derivative


def _one_sided(fn: CapFn) -> CapFn:
  return lambda x, c: fn(x, c, 1.0 / c)


def _two_sided(fn: CapFn) -> CapFn:
  """c_pos for x >= 0, else c_neg: the parameters (and their reciprocals,
  constants) are chosen per element, so fn is evaluated once, not per side."""
  def method(x, c_pos, c_neg):
    pos = x >= 0
    return fn(x, jnp.where(pos, c_pos, c_neg), jnp.where(pos, 1.0 / c_pos, 1.0 / c_neg))
  return method


def tanh_cap(tanh, complement=_one_minus_square) -> tuple[CapFn, CapFn]:
  """(forward, derivative) of the ``tanh`` cap, c*tanh(x/c), built on the given
  tanh function (and ``complement(y, t)``, 1 - tanh(y)^2 from y and its t, for
  the derivative); implementations build faster forms from it with their own."""
  forward, derivative = _tanh_family(tanh, complement)
  return _one_sided(forward), _one_sided(derivative)


def asym_tanh_cap(tanh, complement=_one_minus_square) -> tuple[CapFn, CapFn]:
  """(forward, derivative) of the ``asym_tanh`` cap built on the given tanh
  (and complement, as tanh_cap)."""
  forward, derivative = _tanh_family(tanh, complement)
  return _two_sided(forward), _two_sided(derivative)


def _hard_forward(x, c):
  # Written with where (not clip) so that autodiff gives exactly 1 on the
  # closed interval [-c, c] and 0 outside, the documented derivative.
  return jnp.where(jnp.abs(x) <= c, x, jnp.sign(x) * c)


def tanh_differentiable(y):
  """tanh(y) as (1 - e) / (1 + e) with e = exp(-2|y|), by sign: jnp.tanh's
  values to a few float32 roundings, whose autodiff derivative is
  4e / (1 + e)^2 and does not cancel where tanh saturates. jnp.tanh's is
  1 - t^2: the float32 reference's dq and dk of a saturated cap were a
  rounding off the oracle there, one way on a whole case, and a correct
  kernel read as biased against it (docs/DEFECTS.md, F61)."""
  pos = y >= 0
  a = jnp.where(pos, y, -y)  # |y|, with derivative 1 at 0 (jnp.abs has 0)
  e = jnp.exp(-2.0 * a)
  # 1 - e cancels for small |y|, where expm1 does not; expm1's derivative
  # (autodiff: its value + 1) cancels for large |y|, where 1 - e does not.
  f = jnp.where(a < 0.5, -jnp.expm1(-2.0 * a), 1.0 - e) / (1.0 + e)
  return jnp.where(pos, f, -f)


register_cap_method(
    "none", (), lambda x: x, lambda x: jnp.ones_like(x),
    doc="identity: no cap")
register_cap_method(
    "tanh", ("c",), *tanh_cap(tanh_differentiable),
    doc="soft cap c*tanh(x/c); derivative 1 - tanh(x/c)^2",
    homogeneous=True, bounds=lambda c: (-c, c))
register_cap_method(
    "hard", ("c",), _hard_forward,
    lambda x, c: (jnp.abs(x) <= c).astype(x.dtype),
    doc="clip to [-c, c]; derivative 1 on [-c, c], 0 outside", homogeneous=True,
    bounds=lambda c: (-c, c))
register_cap_method(
    "asym_tanh", ("c_pos", "c_neg"), *asym_tanh_cap(tanh_differentiable),
    doc="tanh soft cap with separate scales for positive (c_pos) and negative "
        "(c_neg) logits; derivative 1 - tanh(x/c)^2 with c of x's side",
    homogeneous=True, bounds=lambda c_pos, c_neg: (-c_neg, c_pos))
