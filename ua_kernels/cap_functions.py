"""Registry of logit-capping methods.

A cap method maps the scaled logits ``s = sm_scale * <q, k>`` elementwise to
capped logits. Each method carries its forward and a hand-written derivative:
the kernels use the derivative directly, the reference differentiates the
forward with autodiff, and the suite checks the two against each other. Adding a
method is one call to :func:`register_cap_method`; the kernels, the reference,
the validation and the Hypothesis strategies all read this registry.

Every parameter of every method is a positive, finite scale (a cap in logit
units); validation rejects anything else, and the strategies draw parameters
around the logits' magnitude so that the cap is actually reached.

A method may also give a fast evaluation of both functions, which the kernels
use for bfloat16 inputs only, whose outputs are rounded to 2^-9 relative anyway
(ua_kernels.attention._fast_cap says why not float16). The tanh family's fast
form is one ``tanh.approx.f32`` instruction (ua_kernels.fast_math, about 2^-11
relative): on the H200 an accurate tanh, two multi-function-unit operations per
logit on top of the softmax's exp2, cost the forward about 35% of its speed
(docs/BENCHMARKS.md). tests/test_cap_methods.py holds every fast form to
FAST_CAP_TOLERANCE, and the bfloat16 properties of the suite hold the kernels
that use them to the same tolerances as everything else.

A method that declares ``bounds`` (the range of its outputs) lets the forward
kernel shift its exp2 by a constant instead of a running row max
(tile_math.fixed_shift); the suite checks the declaration.

A method declared ``homogeneous`` (cap(a*x; a*p) = a*cap(x; p) for a > 0) lets
the kernels move its first parameter into the softmax's exp2 multiply
(tile_math.tile_logits), one multiply per logit fewer; the suite checks the
declaration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax.numpy as jnp

from .fast_math import approx_tanh

# Max |fast - exact| allowed beyond the exact form's own float32 error, relative
# to the largest cap parameter (forward) or absolute (derivative, within [0, 1]):
# float16's rounding, 2^-11, with a factor 2 for the derivative's 2t * dt.
FAST_CAP_TOLERANCE = 2.0 ** -10

CapFn = Callable[..., jnp.ndarray]


@dataclasses.dataclass(frozen=True)
class CapMethod:
  """One registered cap: ``forward(x, *params)`` and ``grad(x, *params)``,
  their fast forms for bfloat16 kernels (the exact ones unless given), and
  whether it is positively homogeneous: forward(a*x, *(a*p)) = a*forward(x, *p)
  for a > 0, which lets the kernels move the first parameter into the exp2's
  multiply (tile_math.tile_logits), and ``bounds(*params) -> (lo, hi)``, the
  range of forward over all x (None: unbounded), which lets the forward kernel
  skip the running max (tile_math.fixed_shift)."""

  name: str
  param_names: tuple[str, ...]
  forward: CapFn
  grad: CapFn
  fast_forward: CapFn
  fast_grad: CapFn
  doc: str = ""
  homogeneous: bool = False
  bounds: Callable[..., tuple[float, float]] | None = None

  def validate_params(self, params: Sequence[float]) -> tuple[float, ...]:
    """Returns params as floats, or raises naming ``cap_params``."""
    try:
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
      if isinstance(value, bool) or not isinstance(value, (int, float)):
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
      out.append(value)
    return tuple(out)


CAP_METHODS: dict[str, CapMethod] = {}


def register_cap_method(name: str, param_names: Sequence[str], forward: CapFn,
                        grad: CapFn, doc: str = "", *, fast_forward: CapFn | None = None,
                        fast_grad: CapFn | None = None, homogeneous: bool = False,
                        bounds: Callable[..., tuple[float, float]] | None = None
                        ) -> CapMethod:
  """Registers a cap method; the whole suite picks it up with no other edit."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"cap method name must be a non-empty string, got {name!r}")
  if name in CAP_METHODS:
    raise ValueError(f"cap method {name!r} is already registered")
  method = CapMethod(name, tuple(param_names), forward, grad,
                     fast_forward or forward, fast_grad or grad, doc, bool(homogeneous),
                     bounds)
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


def _tanh_family(tanh):
  """(forward, derivative) of c*tanh(x/c) in terms of (x, c, 1/c), built on the
  given tanh: a multiply by a constant reciprocal, not a division per element."""
  def forward(x, c, inv_c):
    return c * tanh(x * inv_c)

  def derivative(x, c, inv_c):
    t = tanh(x * inv_c)
    return 1.0 - t * t

  return forward, derivative


_tanh, _tanh_deriv = _tanh_family(jnp.tanh)
_fast_tanh, _fast_tanh_deriv = _tanh_family(approx_tanh)


def _one_sided(fn):
  return lambda x, c: fn(x, c, 1.0 / c)


def _two_sided(fn):
  """c_pos for x >= 0, else c_neg: parameters chosen per element, so the
  function is evaluated once, not on both sides."""
  def method(x, c_pos, c_neg):
    pos = x >= 0
    return fn(x, jnp.where(pos, c_pos, c_neg), jnp.where(pos, 1.0 / c_pos, 1.0 / c_neg))
  return method


def _hard_forward(x, c):
  # Written with where (not clip) so that autodiff gives exactly 1 on the
  # closed interval [-c, c] and 0 outside, the documented derivative.
  return jnp.where(jnp.abs(x) <= c, x, jnp.sign(x) * c)


register_cap_method(
    "none", (), lambda x: x, lambda x: jnp.ones_like(x),
    doc="identity: no cap")
register_cap_method(
    "tanh", ("c",), _one_sided(_tanh), _one_sided(_tanh_deriv),
    doc="soft cap c*tanh(x/c); derivative 1 - tanh(x/c)^2",
    fast_forward=_one_sided(_fast_tanh), fast_grad=_one_sided(_fast_tanh_deriv),
    homogeneous=True, bounds=lambda c: (-c, c))
register_cap_method(
    "hard", ("c",), _hard_forward,
    lambda x, c: (jnp.abs(x) <= c).astype(x.dtype),
    doc="clip to [-c, c]; derivative 1 on [-c, c], 0 outside", homogeneous=True,
    bounds=lambda c: (-c, c))
register_cap_method(
    "asym_tanh", ("c_pos", "c_neg"), _two_sided(_tanh), _two_sided(_tanh_deriv),
    doc="tanh soft cap with separate scales for positive (c_pos) and negative "
        "(c_neg) logits; derivative 1 - tanh(x/c)^2 with c of x's side",
    fast_forward=_two_sided(_fast_tanh), fast_grad=_two_sided(_fast_tanh_deriv),
    homogeneous=True, bounds=lambda c_pos, c_neg: (-c_neg, c_pos))
