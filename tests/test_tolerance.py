"""The tolerance model is tight enough to catch small errors, and fair."""

import dataclasses

import numpy as np
import pytest

from properties.case import Case
from properties.checks import matches_oracle
from properties.capabilities import load_impl
from properties.runner import REFERENCE, baseline, score

BASE = Case(batch=2, seq_len=33, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype="float32",
            causal=True, cap_method="tanh", cap_params=(3.0,), return_lse=True,
            tiles=(16, 32), seed=7)


@pytest.mark.parametrize("output", ["out", "lse", "dq", "dk", "dv"])
@pytest.mark.parametrize("where", ["everywhere", "one_row"])
def test_relative_error_of_1e_3_fails_float32(output, where):
  """A float32 result off by 1e-3 relative (everywhere, or in the largest row)."""
  oracle, _ = baseline(BASE)
  bad = {k: (None if v is None else np.array(v, np.float64)) for k, v in oracle.items()}
  x = bad[output]
  if where == "everywhere":
    x *= 1 + 1e-3
  else:
    row = np.unravel_index(np.argmax(np.abs(np.where(np.isfinite(x), x, 0))), x.shape)
    x[row[:-1]] *= 1 + 1e-3
  errors = {e.name: e for e in score(BASE, bad)}
  assert not errors[output].ok, errors[output]
  assert all(e.ok for name, e in errors.items() if name != output)


def test_oracle_and_reference_pass():
  oracle, _ = baseline(BASE)
  assert all(e.ok and e.max_abs_err == 0 for e in score(BASE, oracle))
  matches_oracle(REFERENCE, BASE)


def test_nan_fails_even_when_tiny_tolerance():
  oracle, _ = baseline(BASE)
  bad = dict(oracle)
  bad["dv"] = np.array(oracle["dv"])
  bad["dv"][0, 0, 0, 0] = np.nan
  errors = {e.name: e for e in score(BASE, bad)}
  assert errors["dv"].nan_count == 1 and not errors["dv"].ok


def test_finite_lse_where_oracle_has_minus_inf_is_caught():
  from properties.tolerance import compare
  e = compare("lse", np.array([0.0, 1.0]), np.array([-np.inf, 1.0]), 0.0, 1e-6)
  assert e.inf_mismatch == 1 and not e.ok


def test_jax_nn_adapter_passes_on_what_it_supports():
  case = dataclasses.replace(BASE, cap_method="none", cap_params=(), return_lse=False,
                             window_len=5, tiles=None)
  matches_oracle(load_impl("properties.impls:jax_nn_attention"), case)


def test_overflow_to_inf_of_the_right_sign_is_accepted():
  from properties.tolerance import compare
  f16 = np.array([np.inf, -np.inf, 1.0], np.float16)
  ok = compare("dq", f16, np.array([7e4, -9e4, 1.0]), 0.0, 1e-3)
  assert ok.ok, ok
  wrong_sign = compare("dq", f16, np.array([-7e4, -9e4, 1.0]), 0.0, 1e-3)
  assert not wrong_sign.ok
  in_range = compare("dq", f16, np.array([6e4, -9e4, 1.0]), 0.0, 1e-3)
  assert not in_range.ok
