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
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import jax.numpy as jnp

CapFn = Callable[..., jnp.ndarray]


@dataclasses.dataclass(frozen=True)
class CapMethod:
  """One registered cap: ``forward(x, *params)`` and ``grad(x, *params)``."""

  name: str
  param_names: tuple[str, ...]
  forward: CapFn
  grad: CapFn
  doc: str = ""

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
                        grad: CapFn, doc: str = "") -> CapMethod:
  """Registers a cap method; the whole suite picks it up with no other edit."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"cap method name must be a non-empty string, got {name!r}")
  if name in CAP_METHODS:
    raise ValueError(f"cap method {name!r} is already registered")
  method = CapMethod(name, tuple(param_names), forward, grad, doc)
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


def _tanh_grad(x, c):
  t = jnp.tanh(x / c)
  return 1.0 - t * t


def _hard_forward(x, c):
  # Written with where (not clip) so that autodiff gives exactly 1 on the
  # closed interval [-c, c] and 0 outside, the documented derivative.
  return jnp.where(jnp.abs(x) <= c, x, jnp.sign(x) * c)


def _asym_tanh_forward(x, c_pos, c_neg):
  return jnp.where(x >= 0, c_pos * jnp.tanh(x / c_pos),
                   c_neg * jnp.tanh(x / c_neg))


def _asym_tanh_grad(x, c_pos, c_neg):
  return jnp.where(x >= 0, _tanh_grad(x, c_pos), _tanh_grad(x, c_neg))


register_cap_method(
    "none", (), lambda x: x, lambda x: jnp.ones_like(x),
    doc="identity: no cap")
register_cap_method(
    "tanh", ("c",), lambda x, c: c * jnp.tanh(x / c), _tanh_grad,
    doc="soft cap c*tanh(x/c); derivative 1 - tanh(x/c)^2")
register_cap_method(
    "hard", ("c",), _hard_forward,
    lambda x, c: (jnp.abs(x) <= c).astype(x.dtype),
    doc="clip to [-c, c]; derivative 1 on [-c, c], 0 outside")
register_cap_method(
    "asym_tanh", ("c_pos", "c_neg"), _asym_tanh_forward, _asym_tanh_grad,
    doc="tanh soft cap with separate scales for positive (c_pos) and negative "
        "(c_neg) logits; derivative 1 - tanh(x/c)^2 with c of x's side")
