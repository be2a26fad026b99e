"""Every property, against the implementation chosen with --impl.

Budgets per property (examples in the ci profile) live in EXAMPLES; other
profiles scale them. A property whose feature the implementation declares
unsupported is skipped with that reason.
"""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.checks import run_property
from properties.impls import unsupported as unsupported_of
from properties.runner import x64
from properties.strategies import cases
from ua_kernels.cap_functions import CAP_METHODS

# property: (examples in ci, required features, forbidden features)
PLAN = {
    "matches_oracle": (42, (), ()),     # split into three dtype tests below
    "key_permutation_invariance": (4, (), ("causal", "window", "segment_ids")),
    "packed_equals_separate": (4, ("segment_ids",), ()),
    "hidden_keys_do_not_leak": (5, (), ()),
    "zero_z_loss_is_no_z_loss": (3, (), ()),
    "unit_temperature_is_none": (3, ("temperature",), ()),
    "huge_tanh_cap_is_no_cap": (3, ("cap",), ()),
    "window_covering_sequence_is_no_window": (3, ("window",), ()),
    "gqa_equals_repeated_heads": (4, ("gqa",), ()),
    "deterministic": (3, (), ()),
}


def _examples(n):
  profile = settings._current_profile
  factor = {"ci": 1, "dev": 3, "fuzz": 25, "gpu": 0.3}.get(profile, 1)
  return settings(max_examples=max(1, round(n * factor)))


def _draw_case(data, impl, buckets, require, forbid, dtypes=None):
  missing = set(require) & unsupported_of(impl)
  if missing:
    pytest.skip(f"implementation declares {sorted(missing)} unsupported")
  return data.draw(cases(buckets, unsupported_of(impl), frozenset(require),
                         frozenset(forbid), dtypes=dtypes), label="case")


def _make_test(prop, n, require, forbid, dtypes=None):
  @_examples(n)
  @given(data=st.data())
  def test(data, impl, impl_name, buckets):
    case = _draw_case(data, impl, buckets, require, forbid, dtypes)
    if prop == "hidden_keys_do_not_leak" and not (
        case.causal or case.window_len or case.segments != "none"):
      if "causal" in unsupported_of(impl):
        pytest.skip("needs causal, a window or segment ids")
      case = dataclasses.replace(case, causal=True)
    if prop == "huge_tanh_cap_is_no_cap" and "tanh" not in CAP_METHODS:
      pytest.skip("no tanh cap registered")
    run_property(prop, impl, impl_name, case)
  test.__name__ = f"test_{prop}"
  return test


for _prop, (_n, _require, _forbid) in PLAN.items():
  if _prop == "matches_oracle":  # one test per dtype, so pytest-xdist can spread them
    for _dtype in ("float32", "bfloat16", "float16"):
      globals()[f"test_{_prop}_{_dtype}"] = _make_test(_prop, _n // 3 + 1, _require, _forbid,
                                                       (_dtype,))
  else:
    globals()[f"test_{_prop}"] = _make_test(_prop, _n, _require, _forbid)


@_examples(6)
@given(data=st.data())
def test_matches_oracle_under_x64(data, impl, impl_name, buckets):
  """The same equivalence with jax_enable_x64 on (16/32-bit inputs)."""
  case = _draw_case(data, impl, buckets, (), ())
  with x64(True):
    run_property("matches_oracle", impl, impl_name, case)
