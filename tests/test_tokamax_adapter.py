"""The tokamax adapter's mapping of the contract onto tokamax's masks, where
tokamax is installed (it needs jax >= 0.11.1, flax and optax: not in CI's
environments, so CI skips this file; docs/PEERS.md says how tokamax was
carried to the GPU machine): tokamax's own XLA op
(``impls_tokamax:tokamax_xla_attention``) under the suite's length properties
and focused oracle tests, on bfloat16 (XLA:CPU has no float16 product for it),
and the masks as tokamax's Mosaic kernels take them apart. Running the
Mosaic-GPU kernel itself needs a Hopper GPU."""

import json
import os
import subprocess
import sys

import pytest

from properties.peers import impls_tokamax

try:
  impls_tokamax._tk()
except ImportError as exc:  # tokamax or one of its dependencies is missing
  pytest.skip(f"tokamax is not importable here: {exc}", allow_module_level=True)

SELECTION = "kv_length or queries_equal or key_blocks or mask_is_exact or mask- or hidden_keys"


def test_the_xla_op_meets_the_contract_on_other_lengths_offsets_and_the_keys_ids(tmp_path):
  """Every selected property passes on tokamax's XLA op, and its cases include
  decode rows, Tq > Tk, offsets and the keys' own ids (the adapter's
  _other_keys_mask, rows without keys among them)."""
  report = tmp_path / "report.json"
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "--pyargs", "properties.suite", "-q",
       "-p", "no:cacheprovider", "--impl=properties.peers.impls_tokamax:tokamax_xla_attention",
       f"--ua-report={report}", f"--ua-failures={tmp_path / 'failures'}", "-k", SELECTION],
      cwd=tmp_path, capture_output=True, text=True, timeout=900,
      env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")))
  assert proc.returncode == 0, proc.stdout[-3000:]
  result = json.loads(report.read_text())
  assert not result["failures"] and not result["crashed"], result["failures"]
  groups = result["feature_groups"]
  for group in ("kv_length:decode", "kv_length:Tq>Tk", "q_offset", "kv_segment_ids"):
    assert groups.get(group, {}).get("cases", 0) >= 1, (group, sorted(groups))


@pytest.mark.parametrize("tq, tk, options", [
    (1, 200, dict(causal=True)), (8, 200, dict(causal=True, window_len=30)),
    (40, 90, dict(causal=True, q_offset=-5)), (40, 90, dict(causal=True, q_offset=20, traced=True)),
    (100, 30, dict(causal=True)), (30, 100, dict(window_len=12)),
    (40, 70, dict(window_len=5, q_offset=80)),  # queries past every key: rows without keys
    (50, 70, dict(causal=True, segments=True)), (65, 64, dict(window_len=7, segments=True)),
])
def test_the_mask_as_the_mosaic_kernel_decomposes_it_is_the_contracts(tq, tk, options):
  """The adapter's mask for keys of another length, as tokamax's Mosaic kernels
  take it apart (pallas_mosaic_gpu_common.decompose_mask: a bool array,
  is_causal, k_start, k_end), is the contract's visible keys on the real rows
  and keys; no real row sees a padded key, no k_end passes Tk (the sm90
  backward does not clamp it), and has_key is each row's "some key visible"."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from tokamax._src.ops.attention.pallas_mosaic_gpu_common import decompose_mask
  from ua_reference import visible_keys
  from ua_reference.contract import validate_call
  rng = np.random.default_rng(tq + tk)
  q, k = jnp.zeros((2, tq, 2, 64), jnp.bfloat16), jnp.zeros((2, tk, 2, 64), jnp.bfloat16)
  options = dict(options)
  traced = options.pop("traced", False)
  if options.pop("segments", False):
    options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, tq))), jnp.int32)
    options["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, tk))), jnp.int32)

  def decomposed(offset):
    call = validate_call(q, k, k, **dict(options, **({} if offset is None else
                                                      {"q_offset": offset})))
    mask, has_key, (tqp, tkp) = impls_tokamax._other_keys_mask(impls_tokamax._tk(), call, tq, tk)
    array, is_causal, k_start, k_end = decompose_mask(
        mask, jnp.zeros((2, tqp, 2, 64)), jnp.zeros((2, tkp, 2, 64)), None, None)
    i, j = jnp.arange(tqp)[:, None], jnp.arange(tkp)[None, :]
    seen = jnp.ones((1, tqp, tkp), bool) if array is None else array.reshape(-1, tqp, tkp)
    seen = seen & (j <= i) if is_causal else seen
    seen = seen if k_start is None else seen & (j >= k_start.reshape(-1, tqp, 1))
    seen = seen if k_end is None else seen & (j < k_end.reshape(-1, tqp, 1))
    return seen, has_key, (tqp, tkp), k_end

  offset = options.pop("q_offset", None)
  if traced:
    seen, has_key, (tqp, tkp), k_end = jax.jit(decomposed)(jnp.int32(offset))
  else:
    seen, has_key, (tqp, tkp), k_end = decomposed(offset)
  want = visible_keys(tq, options.get("segment_ids"), options.get("causal", False),
                      options.get("window_len", 0), kv_seq_len=tk,
                      kv_segment_ids=options.get("kv_segment_ids"),
                      q_offset=tk - tq if offset is None else offset)
  seen, want = np.broadcast_to(seen, (2, tqp, tkp)), np.broadcast_to(want, (2, tq, tk))
  np.testing.assert_array_equal(seen[:, :tq, :tk], want)
  assert not seen[:, :tq, tk:].any()  # no real row sees a padded key
  if "segment_ids" not in options:  # a bound on every row: none past Tk (tkp = tk here)
    assert k_end is not None and int(np.max(k_end)) <= tk, k_end
  np.testing.assert_array_equal(np.broadcast_to(has_key, (2, tq)), want.any(-1))
