"""The kernels' own forms of the cap methods: the exact ones of the contract's
registry (ua_reference.caps), or a registered fast form.

The one precision policy of the caps lives here: which calls take a fast form
(fast_cap: bfloat16 inputs only, whose outputs are rounded to 2^-9 relative
anyway) and which kernels may build every transcendental approximate
(approx_math).
The tanh family's fast form is one ``tanh.approx.f32`` instruction
(ua_kernels.fast_math, about 2^-11 relative) where an accurate tanh takes two
multi-function-unit operations per logit on top of the softmax's exp2
(docs/HISTORY.md, "What moved the forward, measured", says what that
costs). Their derivative is not 1 - t^2 of that t, which cancels near
saturation, but fast_math.tanh_complement. The kernels declare these forms to the suite (``ua_cap_forms``), which
holds them to properties.cap_checks.FORM_TOLERANCE of the exact ones; the
bfloat16 properties hold the kernels that use them to the same tolerances as
everything else.

A method registered in ua_reference without a fast form here runs with its
exact form: registering a cap needs no edit of the kernels.
"""

from __future__ import annotations

import jax.numpy as jnp

from ua_reference.contract import StaticSpec
from ua_reference.caps import CapFn, CapMethod, asym_tanh_cap, get_cap_method, tanh_cap

from .fast_math import approx_tanh, tanh_complement

FAST_FORMS: dict[str, tuple[CapFn, CapFn]] = {}

# Largest cap parameter evaluated with a fast form (fast_cap).
FAST_CAP_MAX_PARAM = 64.0


def fast_cap(spec: StaticSpec, dtype) -> bool:
  """bfloat16 inputs take the caps' fast forms for caps up to
  FAST_CAP_MAX_PARAM. bfloat16's unit roundoff, 2^-9, is four times the fast
  tanh's 2^-11; float16's equals it, and the suite measured the fast form out
  of float16's tolerance, so float16 keeps the exact forms. The fast tanh's
  error is relative to its value, so a capped logit c*tanh(x/c) is off by up
  to c * 2^-11: caps up to 64 keep it within 2^-5 of a logit, larger ones take
  the exact tanh (docs/DEFECTS.md, B16)."""
  return (jnp.dtype(dtype) == jnp.bfloat16
          and max(spec.cap_params, default=0.0) <= FAST_CAP_MAX_PARAM)


def approx_math(spec: StaticSpec, fast: bool) -> bool:
  """Whether a Mosaic kernel is built with approx_math, which makes every
  exp2, log and tanh of the kernel an ``.approx`` instruction: without a cap
  (the softmax's exp2 is the Triton kernels' ex2.approx too) or with the caps'
  fast forms (``fast``, as fast_cap says). Exact caps (float16; caps above
  FAST_CAP_MAX_PARAM) keep accurate transcendentals."""
  return spec.cap_method == "none" or fast


def register_fast_form(name: str, forward: CapFn, grad: CapFn) -> None:
  """Registers the kernels' fast (bfloat16) form of a registered cap method."""
  get_cap_method(name)  # must exist in the contract's registry
  if name in FAST_FORMS:
    raise ValueError(f"a fast form of cap method {name!r} is already registered")
  FAST_FORMS[name] = (forward, grad)


# The exact forms of the tanh family on jnp.tanh, which every Pallas backend
# lowers (the contract's forward is written for its autodiff derivative, on
# expm1); the derivative is the contract's, without cancellation.
EXACT_FORMS: dict[str, tuple[CapFn, CapFn]] = {
    "tanh": tanh_cap(jnp.tanh), "asym_tanh": asym_tanh_cap(jnp.tanh)}


def forms(method: CapMethod, fast: bool) -> tuple[CapFn, CapFn]:
  """(forward, grad) the kernels evaluate for ``method``."""
  if fast and method.name in FAST_FORMS:
    return FAST_FORMS[method.name]
  if method.name in EXACT_FORMS:
    return EXACT_FORMS[method.name]
  return method.forward, method.grad


def fast_forms(name: str) -> tuple[CapFn, CapFn] | None:
  """The fast form of a cap method, or None (the suite's ``ua_cap_forms``)."""
  return FAST_FORMS.get(name)


register_fast_form("tanh", *tanh_cap(approx_tanh, tanh_complement))
register_fast_form("asym_tanh", *asym_tanh_cap(approx_tanh, tanh_complement))
