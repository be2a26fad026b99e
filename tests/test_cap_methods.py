"""Every registered cap method: hand-written gradient == autodiff of the forward.

Runs in float64 over a wide domain (huge magnitudes and the cap boundaries
included). Registering a method is enough for it to be covered here and in
every property of tests/test_properties.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.runner import x64
from ua_kernels.cap_functions import CAP_METHODS

_scales = st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False)


@st.composite
def _points(draw):
  name = draw(st.sampled_from(sorted(CAP_METHODS)))
  params = tuple(draw(_scales) for _ in CAP_METHODS[name].param_names)
  xs = draw(st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=64))
  # Points near each parameter's boundary, both sides, and exactly on it.
  for c in params:
    xs += [c, -c, c * (1 + 1e-9), -c * (1 + 1e-9), c * (1 - 1e-9)]
  return name, params, np.asarray(xs, np.float64)


@settings(max_examples=200)
@given(_points())
def test_hand_written_gradient_matches_autodiff(point):
  name, params, xs = point
  method = CAP_METHODS[name]
  with x64(True):
    x = jnp.asarray(xs)
    auto = jax.vmap(jax.grad(lambda s: method.forward(s, *params)))(x)
    hand = method.grad(x, *params)
    assert hand.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(hand), np.asarray(auto), rtol=1e-10, atol=1e-12,
                               err_msg=f"cap {name} params {params}")
    fwd = np.asarray(method.forward(x, *params))
    assert np.isfinite(fwd).all() and np.isfinite(np.asarray(hand)).all()


def test_builtin_methods_meet_their_definitions():
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
