"""Every registered cap method: hand-written gradient == autodiff of the forward,
and the fast forms (16-bit kernels) within FAST_CAP_TOLERANCE of the exact ones.

Runs over a wide domain (huge magnitudes and the cap boundaries included).
Registering a method is enough for it to be covered here and in every property
of tests/test_properties.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.runner import x64
from ua_kernels.cap_functions import CAP_METHODS, FAST_CAP_TOLERANCE

_scales = st.floats(1e-3, 1e4, allow_nan=False, allow_infinity=False)


@st.composite
def _points(draw, methods=None):
  name = draw(st.sampled_from(sorted(methods or CAP_METHODS)))
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


@settings(max_examples=200)
@given(_points())
def test_fast_forms_match_exact_ones(point):
  """In float32, as the kernels evaluate them: |fast - exact(float64)| may exceed
  the exact form's own float32 error by at most FAST_CAP_TOLERANCE (times the
  largest cap for the forward; derivatives lie in [0, 1]). The float32 error
  term absorbs rounding of x and of the parameters, e.g. at the hard cap's kink."""
  name, params, xs = point
  method = CAP_METHODS[name]
  with x64(True):
    x64_, x32 = jnp.asarray(xs), jnp.asarray(xs, jnp.float32)
    err = lambda a, b: np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
    for fast, exact, scale in ((method.fast_forward, method.forward, max(params, default=1.0)),
                               (method.fast_grad, method.grad, 1.0)):
      truth = exact(x64_, *params)
      fast32 = fast(x32, *params)
      assert fast32.dtype == jnp.float32
      excess = err(fast32, truth) - err(exact(x32, *params), truth)
      assert np.max(excess) <= FAST_CAP_TOLERANCE * scale, (name, params, fast)


_HOMOGENEOUS = [name for name, m in CAP_METHODS.items() if m.homogeneous]


@settings(max_examples=200)
@given(_points(_HOMOGENEOUS), st.floats(1e-3, 1e3))
def test_declared_homogeneity_holds(point, a):
  """A method declared homogeneous is evaluated by the kernels as
  a*cap(x/a; p/a) (its first parameter moved into the exp2): that must be the
  same function, with the same derivative."""
  name, params, xs = point
  method = CAP_METHODS[name]
  with x64(True):
    x = jnp.asarray(xs)
    scaled_params = tuple(c / a for c in params)
    np.testing.assert_allclose(np.asarray(a * method.forward(x / a, *scaled_params)),
                               np.asarray(method.forward(x, *params)), rtol=1e-12, atol=1e-300)
    # Derivative steps (the hard cap's) sit at |x| = a parameter; x/a may cross them.
    kink = np.isclose(np.abs(xs)[:, None], np.asarray(params)[None, :], rtol=1e-6).any(axis=1)
    np.testing.assert_allclose(np.asarray(method.grad(x / a, *scaled_params))[~kink],
                               np.asarray(method.grad(x, *params))[~kink], rtol=1e-10, atol=1e-12)


_BOUNDED = [name for name, m in CAP_METHODS.items() if m.bounds is not None]


@settings(max_examples=200)
@given(_points(_BOUNDED))
def test_declared_bounds_hold(point):
  """A method's declared bounds(*params) = (lo, hi) contain every output, exact
  and fast (the forward kernel shifts its exp2 by their midpoint instead of a
  row max: tile_math.fixed_shift), and are reached: a loose bound would only
  waste range, a wrong one would overflow."""
  name, params, xs = point
  method = CAP_METHODS[name]
  lo, hi = method.bounds(*params)
  slack = FAST_CAP_TOLERANCE * max(params)
  ends = np.asarray([-1e30, 1e30, -np.inf, np.inf])
  with x64(True):
    exact = np.asarray(method.forward(jnp.asarray(np.concatenate([xs, ends])), *params))
  fast = np.asarray(method.fast_forward(jnp.asarray(np.concatenate([xs, ends]), jnp.float32),
                                        *params), np.float64)
  assert lo <= exact.min() and exact.max() <= hi, (name, params, lo, hi)
  assert lo - slack <= fast.min() and fast.max() <= hi + slack, (name, params, lo, hi)
  np.testing.assert_allclose(exact[-4:-2], [lo, hi], rtol=1e-12)


def test_fast_tanh_emulation_has_the_instructions_error_size():
  """Off the GPU the fast tanh is emulated with an error of tanh.approx.f32's size
  (ua_kernels.fast_math), so the CPU suite measures that error's effect: it must be
  visibly approximate, not the exact function again."""
  tanh = CAP_METHODS["tanh"]
  x = jnp.linspace(-20.0, 20.0, 4001, dtype=jnp.float32)
  err = np.abs(np.asarray(tanh.fast_forward(x, 3.0), np.float64)
               - 3 * np.tanh(np.asarray(x, np.float64) / 3))
  assert 2.0 ** -14 * 3 < err.max() <= FAST_CAP_TOLERANCE * 3
  ends = jnp.asarray([-1e6, 1e6], jnp.float32)
  np.testing.assert_array_equal(np.asarray(tanh.fast_forward(ends, 3.0)), [-3.0, 3.0])
  np.testing.assert_array_equal(np.asarray(tanh.fast_grad(ends, 3.0)), [0.0, 0.0])


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
