"""The suite is implementation-agnostic: the reference and jax.nn's attention
(through an adapter that declares what it lacks) pass its properties, drawn
from the same registry as the suite's own tests."""

import dataclasses

import pytest
from hypothesis import given, settings

from properties.capabilities import load_impl
from properties.profiles import PROFILES
from properties.registry import PROPERTIES
from properties.strategies import cases
from properties.verifier import Verifier

PLUGINS = ("ua_reference:attention", "properties.impls:jax_nn_attention")
CHECKED = [p for p in PROPERTIES if p.name in (
    "matches_oracle", "gqa_equals_repeated_heads", "hidden_keys_do_not_leak", "deterministic")]


@pytest.mark.parametrize("name", PLUGINS)
@pytest.mark.parametrize("prop", CHECKED, ids=[p.name for p in CHECKED])
def test_plugin_passes(name, prop, tmp_path):
  impl = load_impl(name)
  strategy = cases(PROFILES["ci"].buckets, impl, prop.require, prop.forbid,
                   prop.any_of).filter(prop.applies)
  verifier = Verifier(impl, str(tmp_path))

  @settings(max_examples=3, derandomize=True, database=None, deadline=None)
  @given(strategy)
  def run(case):
    verifier.check(prop, case)

  run()


def test_adapter_declares_what_it_lacks():
  impl = load_impl("properties.impls:jax_nn_attention")
  assert impl.unsupported == {"segment_ids", "cap", "temperature", "z_loss", "lse"}
  cudnn = load_impl("properties.impls:jax_nn_cudnn")
  assert cudnn.dtypes == ("bfloat16", "float16") and not cudnn.head_dims(256)
  with pytest.raises(ValueError, match="module:function"):
    load_impl("ua_kernels.attention")
