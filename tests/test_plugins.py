"""The suite is implementation-agnostic: the reference and jax.nn's attention
(through an adapter that declares what it lacks) pass its properties."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from properties.checks import run_property
from properties.impls import jax_nn_attention, load_impl, reference_impl, unsupported
from properties.strategies import cases

PLUGINS = {"properties.impls:reference_impl": reference_impl,
           "properties.impls:jax_nn_attention": jax_nn_attention}
PROPS = ["matches_oracle", "gqa_equals_repeated_heads", "hidden_keys_do_not_leak",
         "deterministic"]


@pytest.mark.parametrize("name", sorted(PLUGINS))
@pytest.mark.parametrize("prop", PROPS)
@settings(max_examples=3)
@given(data=st.data())
def test_plugin_passes(name, prop, data, buckets):
  impl = PLUGINS[name]
  require = {"gqa_equals_repeated_heads": {"gqa"}, "hidden_keys_do_not_leak": {"causal"}}
  case = data.draw(cases(buckets, unsupported(impl), frozenset(require.get(prop, ()))))
  run_property(prop, impl, name, case)


def test_adapter_declares_what_it_lacks():
  assert unsupported(jax_nn_attention) == {"segment_ids", "cap", "temperature", "z_loss", "lse"}
  assert load_impl("properties.impls:jax_nn_attention") is jax_nn_attention
  with pytest.raises(ValueError, match="module:function"):
    load_impl("ua_kernels.attention")
