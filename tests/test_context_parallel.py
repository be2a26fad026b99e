"""Context-parallel attention (ua_kernels.context_parallel) over virtual CPU
devices: the sharded op against the single-device kernels, outputs and every
gradient, for 2 shards (not causal), 4 and 3 (causal: the zig-zag layout's
full, diagonal and hidden pairs), with windows that cross shard boundaries, documents
that span shards, GQA, temperature, a cap, the z-loss and lse, and without key
blocks (the kernels' own full and diagonal pairs); every property of the suite
over 2 and 4 shards, sharded_equals_unsharded included; and clear errors for bad
input.

The sharded runs need several devices, which a process fixes when jax starts
(``--xla_force_host_platform_device_count``): they run in a subprocess."""

import json
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import ua_kernels
from ua_kernels import context_parallel
from ua_reference.contract import validate

SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    import ua_kernels
    from ua_kernels import context_parallel

    rng = np.random.default_rng(0)
    B, T, HQ, HKV, D = 1, 64, 4, 2, 16
    q, dout = (jnp.asarray(rng.standard_normal((B, T, HQ, D)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, T, HKV, D)), jnp.bfloat16) for _ in range(2))
    temp = jnp.asarray(rng.uniform(0.5, 2.0, (B, T, HQ)), jnp.float32)
    dlse = jnp.asarray(rng.standard_normal((B, HQ, T)), jnp.float32)
    # Documents of 5 to 23 tokens: most cross a shard boundary (chunks of 8 or 16).
    seg = jnp.asarray(np.cumsum(rng.random(T) < 0.1)[None], jnp.int32)
    f32 = lambda x: np.asarray(jnp.asarray(x, jnp.float32))
    # Key blocks (a window, documents) and the kernels' own pairs (neither), each
    # over 2 shards not causal and 4 causal; and 3 causal shards with key blocks (a
    # ring of three steps: a middle one in the scan), on the first 60 positions.
    for shards, causal, window, with_seg in ((2, False, 12, True), (4, True, 12, True),
                                             (2, False, 0, False), (4, True, 0, False),
                                             (3, True, 12, True)):
      t = T - T % (2 * shards)
      cut = lambda x, axis=1: None if x is None else jax.lax.slice_in_dim(x, 0, t, axis=axis)
      mesh = Mesh(np.array(jax.devices()[:shards]), ("context",))
      kw = dict(causal=causal, window_len=window, segment_ids=cut(seg) if with_seg else None,
                cap_method="tanh", cap_params=(3.0,), temperature=cut(temp), z_loss_weight=0.1,
                return_lse=True)
      results = []
      for f in (lambda q, k, v: ua_kernels.attention(q, k, v, **kw),
                jax.jit(lambda q, k, v: context_parallel.attention(
                    q, k, v, mesh=mesh, axis="context", **kw))):
        (out, lse), vjp = jax.vjp(f, cut(q), cut(k), cut(v))
        results.append([out, lse, *vjp((cut(dout), cut(dlse, axis=2)))])
      for name, one, sharded in zip(("out", "lse", "dq", "dk", "dv"), *results):
        scale = max(float(np.abs(f32(one)).max()), 1.0)
        err = float(np.abs(f32(one) - f32(sharded)).max())
        print(f"{shards}-{causal}-{window}-{with_seg} {name} {err / scale:.3e}")
    pair = Mesh(np.array(jax.devices()[:2]), ("context",))
    try:  # 14 tokens cannot make 4 zig-zag chunks over 2 devices
      context_parallel.attention(q[:, :14], k[:, :14], v[:, :14], mesh=pair, axis="context")
    except ValueError as exc:
      print("refused:", exc)
""")

# Relative to the output's largest element: the sharded op rounds each shard's
# partial output to bfloat16 before the merge, a few bfloat16 ulps (2^-8) apart
# from the single call; a wrong mask or a lost z-loss gradient moves outputs by
# tenths.
BOUND = 4 * 2.0 ** -8


def test_sharded_matches_the_single_device_call():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                        timeout=600, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = proc.stdout.splitlines()
  refused = [line for line in lines if line.startswith("refused:")]
  assert len(refused) == 1 and "multiple of twice" in refused[0], proc.stdout
  rows = [line.split() for line in lines if line not in refused]
  assert len(rows) == 25, proc.stdout
  worst = {(config, name): float(err) for config, name, err in rows}
  assert all(err < BOUND for err in worst.values()), worst


def _inputs(t=16):
  x = jnp.zeros((1, t, 2, 16), jnp.bfloat16)
  return x, x, x


def test_bad_input_is_refused_by_name():
  """(A length the zig-zag layout cannot cut needs two devices: the script of
  test_sharded_matches_the_single_device_call checks that refusal.)"""
  mesh = Mesh(np.array(jax.devices()[:1]), ("context",))
  q, k, v = _inputs()
  with pytest.raises(ValueError, match="axis 'ring'"):
    context_parallel.attention(q, k, v, mesh=mesh, axis="ring")
  with pytest.raises(TypeError, match="mesh must be"):
    context_parallel.attention(q, k, v, mesh="context", axis="context")


def test_one_shard_is_the_plain_call():
  """P = 1 is the plain call: the same lowered program, forward and gradient
  (so it costs nothing over it; docs/CONTEXT_PARALLEL.md has its timing on the
  H200), the same values at any T (odd included); the ring of one step (two
  zig-zag chunks on the one device, as timed against it by
  benchmarks/context_parallel.py) agrees with it."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("context",))
  x = jnp.zeros((1, 15, 2, 16), jnp.bfloat16)
  kw = dict(causal=True, window_len=5, cap_method="tanh", cap_params=(3.0,), z_loss_weight=0.1,
            return_lse=True)
  calls = (lambda q, k, v: context_parallel.attention(q, k, v, mesh=mesh, axis="context", **kw),
           lambda q, k, v: ua_kernels.attention(q, k, v, **kw))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v)[0].astype(jnp.float32))
  for wrap in (jax.jit, lambda f: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))):
    one, plain = (re.sub(r"jit_\w+", "jit_f", wrap(f).lower(x, x, x).as_text()) for f in calls)
    assert one == plain
  rng = np.random.default_rng(1)
  for t in (16, 15):
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 2, 16)), jnp.float32) for _ in range(3))
    one = context_parallel.attention(q, k, v, mesh=mesh, axis="context", causal=True)
    plain = ua_kernels.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(plain))
  q, k, v = (jnp.asarray(rng.standard_normal((1, 16, 2, 16)), jnp.float32) for _ in range(3))
  spec, _, _ = validate(q, k, v, causal=True)
  ring = context_parallel._ring_attention(
      q, k, v, mesh=mesh, axis="context", spec=spec, segment_ids=None, causal=True,
      cap_method="none", cap_params=(), temperature=None, z_loss_weight=0.0,
      return_lse=False, config=None)
  plain = ua_kernels.attention(q, k, v, causal=True)
  np.testing.assert_allclose(np.asarray(ring), np.asarray(plain), atol=1e-5)


# One test of each property (matches_oracle in two dtypes), and the focused mask
# tests: lengths past two tiles, so windows and documents cross the chunks.
SUITE_TESTS = (
    "matches_oracle-bfloat16", "matches_oracle-float32", "matches_oracle_under_x64",
    "key_permutation_invariance", "packed_equals_separate", "hidden_keys_do_not_leak",
    "mask_is_exact", "zero_z_loss_is_no_z_loss", "unit_temperature_is_none",
    "huge_tanh_cap_is_no_cap", "window_covering_sequence_is_no_window",
    "gqa_equals_repeated_heads", "deterministic", "sharded_equals_unsharded",
    "matches_oracle-bfloat16-mask-causal", "matches_oracle-bfloat16-mask-window",
    "matches_oracle-bfloat16-mask-segment_ids")


@pytest.mark.parametrize("shards", [4])
def test_the_suite_verifies_the_sharded_op_over_virtual_devices(tmp_path, shards):
  """The sharded op is an implementation like any other: the installed suite
  loads ``ua_kernels.context_parallel:on_{shards}_devices`` (lengths rounded to
  multiples of 2 x shards, around the kernels' 16-row tiles) over that many
  virtual devices and runs every property, against the sharded op's
  single-device counterpart too (sharded_equals_unsharded), the first example
  of each (the focused mask tests' on lengths of two tiles and more); every
  case passes. Four shards: a ring of three steps past the first, each shard
  both a zig-zag pair's early and late chunk; two and three shards are
  test_sharded_matches_the_single_device_call's (their suite runs cost CI
  minutes and found nothing four did not). Further examples take minutes per
  property here: docs/CONTEXT_PARALLEL.md records those runs."""
  from properties.checks.registry import PROPERTIES

  report = tmp_path / "report.json"
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={shards}"
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "--pyargs", "properties.suite", "-q",
       "-p", "no:cacheprovider", f"--impl=ua_kernels.context_parallel:on_{shards}_devices",
       f"--ua-report={report}", f"--ua-failures={tmp_path / 'failures'}",
       "--ua-max-examples=1", "-k", " or ".join(f"test_property[{t}]" for t in SUITE_TESTS)],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-3000:]
  result = json.loads(report.read_text())
  assert not result["failures"] and not result["crashed"], result["properties"]
  ran = {name for name, row in result["properties"].items() if row["cases"]}
  from properties.model.capabilities import load_impl
  impl = load_impl(f"ua_kernels.context_parallel:on_{shards}_devices")
  assert ran == {p.name for p in PROPERTIES if p.unsupported_by(impl) is None}, sorted(ran)
  assert len(result["records"]) == len(SUITE_TESTS), result["records"]
  assert all(r["seq_len"] % (2 * shards) == 0 for r in result["records"]), result["records"]
  # The focused mask tests' cases: the only oracle cases past two 16-row tiles.
  masks = [r for r in result["records"] if r["property"] == "matches_oracle"
           and r["seq_len"] > 2 * 16]
  assert len(masks) == 3, result["records"]
