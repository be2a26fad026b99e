"""The tokamax adapter's mapping of the contract onto tokamax's masks, where
tokamax is installed (it needs jax >= 0.11.1, flax and optax: not in CI's
environments, so CI skips this file; docs/PEERS.md says how tokamax was
carried to the GPU machine): tokamax's own XLA op
(``impls_tokamax:tokamax_xla_attention``) under the suite's length properties
and focused oracle tests, on bfloat16 (XLA:CPU has no float16 product for it). The
Mosaic-GPU kernel behind the same mapping needs a Hopper GPU."""

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
