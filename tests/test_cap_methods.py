"""Every registered cap method against its declarations (properties/checks/cap_checks.py):
hand-written derivative == autodiff of the forward, declared bounds and
homogeneity hold, and the kernels' fast forms (bfloat16) are within
FORM_TOLERANCE of the exact ones. Registering a method is enough for it to be
covered here and in every property of the suite."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.checks import cap_checks
from properties.checks.cap_checks import FORM_TOLERANCE, cap_points, check_all
from ua_kernels import cap_forms
from ua_reference.caps import CAP_METHODS


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(cap_points(CAP_METHODS), st.floats(1e-3, 1e3))
def test_registered_methods_meet_their_declarations(point, a):
  name, params, xs = point
  check_all(CAP_METHODS[name], params, xs, cap_forms.fast_forms(name), a)


_TANH = CAP_METHODS["tanh"]


@pytest.mark.parametrize("changes, message", [
    (dict(grad=lambda x, c: jnp.ones_like(x)), "derivative differs from autodiff"),
    (dict(bounds=lambda c: (-c / 2, c / 2)), "outside the declared bounds"),
    (dict(bounds=lambda c: (-2 * c, 2 * c)), "not reached"),
    (dict(forward=lambda x, c: c * jnp.tanh(x), grad=lambda x, c: c * (1 - jnp.tanh(x) ** 2)),
     "declared homogeneous"),
    (dict(forward=lambda x, c: jnp.where(jnp.abs(x) > 5.0, jnp.nan, c * jnp.tanh(x / c)),
          grad=lambda x, c: 1 - jnp.tanh(x / c) ** 2, homogeneous=False),
     "non-finite output"),
], ids=["derivative", "bounds-too-tight", "bounds-not-reached", "not-homogeneous", "nan"])
def test_each_check_names_the_method_and_the_point(changes, message):
  """A declaration the function contradicts is reported with the method's
  name, its parameters and an x where they disagree."""
  method = dataclasses.replace(_TANH, name="broken_test", **changes)
  CAP_METHODS[method.name] = method
  try:
    problem = cap_checks.precheck(method.name, examples=100)
  finally:
    del CAP_METHODS[method.name]
  assert problem is not None and "'broken_test'" in problem and "params" in problem
  assert message in problem, problem


def test_a_fast_form_off_by_more_than_the_tolerance_is_caught():
  tanh = CAP_METHODS["tanh"]
  sloppy = (lambda x, c: tanh.forward(x, c) * (1 + 8 * FORM_TOLERANCE), tanh.grad)
  with pytest.raises(cap_checks.CapCheckFailure, match="forward form is off"):
    cap_checks.check_forms(tanh, sloppy, (3.0,), np.linspace(-20, 20, 101))


def test_fast_tanh_emulation_has_the_instructions_error_size():
  """Off the GPU the fast tanh is emulated with an error of tanh.approx.f32's size
  (ua_kernels.fast_math), so the CPU suite measures that error's effect: it must be
  visibly approximate, not the exact function again."""
  forward, grad = cap_forms.fast_forms("tanh")
  x = jnp.linspace(-20.0, 20.0, 4001, dtype=jnp.float32)
  err = np.abs(np.asarray(forward(x, 3.0), np.float64)
               - 3 * np.tanh(np.asarray(x, np.float64) / 3))
  assert 2.0 ** -14 * 3 < err.max() <= FORM_TOLERANCE * 3
  ends = jnp.asarray([-1e6, 1e6], jnp.float32)
  np.testing.assert_array_equal(np.asarray(forward(ends, 3.0)), [-3.0, 3.0])
  np.testing.assert_array_equal(np.asarray(grad(ends, 3.0)), [0.0, 0.0])


def test_builtin_methods_meet_their_definitions():
  from properties.judge.runner import x64
  x = np.linspace(-30, 30, 601)
  with x64(True):
    f = lambda name, *p: np.asarray(CAP_METHODS[name].forward(jnp.asarray(x), *p))
    np.testing.assert_allclose(f("none"), x)
    np.testing.assert_allclose(f("tanh", 5.0), 5 * np.tanh(x / 5), rtol=1e-14)
    np.testing.assert_allclose(f("hard", 5.0), np.clip(x, -5, 5))
    np.testing.assert_allclose(f("asym_tanh", 5.0, 2.0),
                               np.where(x >= 0, 5 * np.tanh(x / 5), 2 * np.tanh(x / 2)))
    hard_grad = np.asarray(CAP_METHODS["hard"].grad(jnp.asarray([-5.0, 5.0, 5.0001, -7.0]), 5.0))
    np.testing.assert_array_equal(hard_grad, [1.0, 1.0, 0.0, 0.0])


def test_the_documented_softsign_example_meets_its_declarations():
  """docs/ADDING_A_CAP_METHOD.md's softsign, c*x/(c+|x|): its bounds are limits
  (at x = inf the formula is inf/inf), passed by one rounding at x = 1e30, and
  its homogeneity holds up to float64 subnormals, which XLA:CPU flushes."""
  method = dataclasses.replace(
      _TANH, name="softsign_test", forward=lambda x, c: c * x / (c + jnp.abs(x)),
      grad=lambda x, c: (c / (c + jnp.abs(x))) ** 2, doc="c*x/(c+|x|)")
  for declared in (method, dataclasses.replace(method, bounds=None)):
    CAP_METHODS[method.name] = declared
    try:
      assert cap_checks.precheck(method.name, examples=200) is None
      cap_checks.check_homogeneous(declared, (1.0,), np.asarray([2.35e-300, -1e-260, 3.0]), 326.0)
    finally:
      del CAP_METHODS[method.name]
