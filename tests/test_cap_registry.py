"""Registering a cap method is the only step: kernels, reference and suite pick it up."""

import dataclasses

import jax.numpy as jnp
import pytest

import ua_kernels
from properties.model.capabilities import declare
from properties.model.case import Case
from properties.checks.checks import matches_oracle
from ua_reference import caps

KERNELS = declare("ua_kernels:attention", ua_kernels.attention)


@pytest.fixture
def softsign():
  method = caps.register_cap_method(
      "softsign_test", ("c",), lambda x, c: c * x / (c + jnp.abs(x)),
      lambda x, c: (c / (c + jnp.abs(x))) ** 2, doc="test-only")
  yield method
  del caps.CAP_METHODS["softsign_test"]


def test_new_method_runs_through_kernels_and_reference(softsign):
  case = Case(batch=1, seq_len=20, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="float32", causal=True, cap_method="softsign_test", cap_params=(0.5,),
              return_lse=True, tiles=(16, 16), seed=3)
  matches_oracle(KERNELS, case)
  # A wrong hand-written derivative is caught by the same property.
  caps.register_cap_method("softsign_broken", ("c",), softsign.forward,
                           lambda x, c: jnp.ones_like(x))
  try:
    with pytest.raises(AssertionError, match="out of tolerance"):
      matches_oracle(KERNELS, dataclasses.replace(case, cap_method="softsign_broken"))
  finally:
    del caps.CAP_METHODS["softsign_broken"]


def test_duplicate_registration_rejected(softsign):
  with pytest.raises(ValueError, match="already registered"):
    caps.register_cap_method("softsign_test", ("c",), lambda x, c: x, lambda x, c: x)


def test_fast_form_needs_a_registered_method():
  with pytest.raises(ValueError, match="unknown cap_method"):
    ua_kernels.register_fast_form("no_such_cap", lambda x: x, lambda x: x)
  with pytest.raises(ValueError, match="already registered"):
    ua_kernels.register_fast_form("tanh", lambda x, c: x, lambda x, c: x)
