"""The suite is implementation-agnostic: the reference and jax.nn's attention
(through an adapter that declares what it lacks) pass its properties, drawn
from the same registry as the suite's own tests."""


import pytest
from hypothesis import given, settings

from properties.model.capabilities import load_impl
from properties.model.profiles import PROFILES
from properties.checks.registry import PROPERTIES
from properties.model.strategies import cases
from properties.run.verifier import Verifier

PLUGINS = ("ua_reference:attention", "properties.peers.impls:jax_nn_attention")
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
  impl = load_impl("properties.peers.impls:jax_nn_attention")
  assert impl.unsupported == {"segment_ids", "cap", "temperature", "z_loss", "lse",
                              "kv_segment_ids", "sinks"}
  cudnn = load_impl("properties.peers.impls:jax_nn_cudnn")
  assert cudnn.dtypes == ("bfloat16", "float16") and not cudnn.head_dims(256)
  with pytest.raises(ValueError, match="module:function"):
    load_impl("ua_kernels.attention")


def test_the_worked_example_of_plugins_md_runs_from_its_text(tmp_path):
  """docs/PLUGINS.md's "Bring your own kernel", pasted into an empty directory
  and verified there by ua-verify, as a user does (the cases that show its
  declarations at work: masks at 128-row tile edges, head dims 128/256)."""
  import os
  import pathlib
  import re
  import subprocess
  import sys
  doc = (pathlib.Path(__file__).parents[1] / "docs" / "PLUGINS.md").read_text()
  source = re.search(r"<!-- example: my_attention.py -->\n```python\n(.*?)```", doc, re.S)
  (tmp_path / "my_attention.py").write_text(source.group(1))
  proc = subprocess.run(
      [sys.executable, "-c",
       "import sys; from properties.cli import verify_main; sys.exit(verify_main())",
       "--impl", "my_attention:attention", "-n", "0", "--",
       "-k", "matches_oracle-bfloat16-mask or mask_is_exact"],
      cwd=tmp_path, env=dict(os.environ, PYTHONPATH="."), capture_output=True, text=True,
      timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
  assert "PASS: my_attention:attention" in proc.stdout
  assert "head_dim:>128" in proc.stdout and "head_dim:<=64" not in proc.stdout


@pytest.mark.parametrize("tq, tk, q_offset, window", [(1, 37, None, 0), (40, 21, None, 5),
                                                      (12, 29, -15, 0), (9, 20, 30, 4)])
def test_the_jax_nn_adapter_places_queries_at_their_offset(tq, tk, q_offset, window):
  """jax.nn's own masks align the first query with the first key; the adapter
  passes the contract's (rows without keys included: 0, not jax.nn's mean of v)."""
  import jax.numpy as jnp
  import numpy as np
  import ua_reference
  from properties.peers.impls import jax_nn_attention
  rng = np.random.default_rng(tq)
  q = jnp.asarray(rng.normal(size=(2, tq, 2, 16)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, tk, 2, 16)), jnp.float32) for _ in range(2))
  kw = dict(causal=True, window_len=window, q_offset=q_offset)
  np.testing.assert_allclose(np.asarray(jax_nn_attention(q, k, v, **kw)),
                             np.asarray(ua_reference.attention(q, k, v, **kw)), atol=2e-6)
