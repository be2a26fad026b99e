"""Registering a cap method is the only step: kernels, reference and suite pick it up."""

import dataclasses

import jax.numpy as jnp
import pytest

from properties.case import Case
from properties.checks import matches_oracle
from ua_kernels import cap_functions


@pytest.fixture
def softsign():
  method = cap_functions.register_cap_method(
      "softsign_test", ("c",), lambda x, c: c * x / (c + jnp.abs(x)),
      lambda x, c: (c / (c + jnp.abs(x))) ** 2, doc="test-only")
  yield method
  del cap_functions.CAP_METHODS["softsign_test"]


def test_new_method_runs_through_kernels_and_reference(softsign):
  import ua_kernels
  case = Case(batch=1, seq_len=20, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="float32", causal=True, cap_method="softsign_test", cap_params=(0.5,),
              return_lse=True, blocks=(16,) * 6, seed=3)
  matches_oracle(ua_kernels.attention, case)
  # A wrong hand-written derivative is caught by the same property.
  cap_functions.register_cap_method("softsign_broken", ("c",), softsign.forward,
                                    lambda x, c: jnp.ones_like(x))
  try:
    with pytest.raises(AssertionError, match="out of tolerance"):
      matches_oracle(ua_kernels.attention, dataclasses.replace(case, cap_method="softsign_broken"))
  finally:
    del cap_functions.CAP_METHODS["softsign_broken"]


def test_duplicate_registration_rejected(softsign):
  with pytest.raises(ValueError, match="already registered"):
    cap_functions.register_cap_method("softsign_test", ("c",), lambda x, c: x, lambda x, c: x)
