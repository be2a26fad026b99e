"""Kernels shaped unlike ours, run through the installed suite as a client runs
them (tests/outside_kernels.py): narrow declarations (D 128/256 only, 128-row
tiles, bfloat16 alone) and callables that capture device arrays, jit or vmap
inside, or carry their own custom_vjp pass; planted defects of those shapes
fail. The tests select the properties that show each; docs/PLUGINS.md ("Declaring
what an implementation supports") says how a kernel declares its limits."""

import os

import pytest

from test_suite_plugin import run_suite


# XLA:CPU flags that buy compile time with run time (.ci/run's pytest stage).
COMPILE_TIME_FLAGS = ("--xla_backend_optimization_level", "--xla_cpu_use_fusion_emitters",
                      "--xla_cpu_parallel_codegen_split_count")


def _problems(report):
  return sum(r["failures"] + r["harness_errors"] for r in report["properties"].values())


def test_a_narrow_kernel_is_drawn_at_its_own_head_dims_and_tiles(tmp_path):
  proc, report = run_suite(tmp_path, "outside_kernels:narrow_attention", "-n", "2", "-k",
                           "matches_oracle-bfloat16- or mask_is_exact or packed_equals")
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert report["cases"] >= 8 and _problems(report) == 0
  groups = report["feature_groups"]
  assert groups["head_dim:65-128"]["cases"] and groups["head_dim:>128"]["cases"]
  assert "head_dim:<=64" not in groups
  assert any(r["seq_len"] > 128 for r in report["records"])
  # What cannot be drawn is skipped, with the declaration that rules it out.
  assert any("declares cap method 'hard' unsupported" in r for r in report["skipped"]), \
      report["skipped"]
  assert "skipped: " in proc.stdout


def test_a_narrow_kernel_with_a_causal_off_by_one_fails(tmp_path):
  proc, report = run_suite(tmp_path, "outside_kernels:narrow_off_by_one_attention",
                           "-k", "matches_oracle-bfloat16-mask-causal")
  assert proc.returncode == 1
  assert [f["status"] for f in report["failures"]] == ["failed"], report["failures"]


@pytest.mark.parametrize("name", ["closure", "inner_jit", "inner_vmap", "custom_vjp"])
def test_callables_over_captured_arrays_pass(name, tmp_path):
  # The harness errors such callables met came on their first case: three
  # configurations of each show them gone.
  proc, report = run_suite(tmp_path, f"outside_kernels:{name}_attention", "-k",
                           "matches_oracle-float32 and not cap and not mask and not long and not feature",
                           "--ua-max-examples=3")
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert report["cases"] >= 3 and _problems(report) == 0


@pytest.mark.parametrize("name, select", [
    ("head_dim_above_128_halved", "matches_oracle-float32-cap-hard"),
    ("segment_ids_8_bit", "mask_is_exact"),
])
def test_planted_defects_of_other_classes_fail_the_ci_profile(name, select, tmp_path):
  proc, report = run_suite(tmp_path, f"outside_kernels:{name}_attention", "-k", select)
  assert proc.returncode == 1
  assert report["failures"] and report["failures"][0]["status"] == "failed"


def test_a_clients_first_failure_reads_in_a_screen(tmp_path):
  """ua-verify on a planted bug: no tracebacks through the suite before the
  report, and the report's failure block names the smallest case with its
  replay and minimize commands."""
  import os
  import subprocess
  import sys
  from test_suite_plugin import TESTS
  env = dict(os.environ, PYTHONPATH=str(TESTS))
  proc = subprocess.run(
      [sys.executable, "-c",
       "import sys; from properties.cli import verify_main; sys.exit(verify_main())", "--impl", "outside_kernels:narrow_off_by_one_attention", "-n", "0", "--",
       "-k", "matches_oracle-bfloat16-mask-causal or mask_is_exact"],
      cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 1, proc.stdout[-3000:]
  before, _, report = proc.stdout.partition("unified-attention verification")
  assert len(before.splitlines()) <= 60 and "Traceback" not in before, before
  block = report[report.index("distinct; the smallest"):].splitlines()
  failed = [i for i, line in enumerate(block) if line.startswith("FAILED ")]
  assert failed and block[failed[0] + 1].startswith("  case:     B=")
  replay = block[failed[0] + 3]
  assert replay.startswith("  replay:   ua-repro ") and block[failed[0] + 4].endswith("--minimize")


def test_a_cached_tracer_is_named_as_the_implementations_defect(tmp_path):
  """An implementation that caches an array built inside a trace (the way a
  splash kernel cached across calls keeps its mask tables): the harness's
  compiled call says what leaked, not only that the arity differs."""
  proc, report = run_suite(tmp_path, "outside_kernels:leaky_cache_attention",
                           "-k", "matches_oracle-float32 and not cap and not mask and not long and not feature")
  assert proc.returncode == 1
  failed = [f for f in report["failures"] if f["status"] == "failed"]
  assert failed and "closes over a value traced in another computation" in failed[0]["message"]


def test_splash_attention_runs_under_the_suite_in_interpret_mode(tmp_path):
  """JAX's splash attention (a TPU kernel, in its interpret mode here) through
  its adapter: the mask, hidden-key and packed-document properties pass, wide
  segment ids and GQA included; its oracle failures are classified in
  docs/PEERS.md ("Splash attention on this CPU")."""
  # XLA's default code generation: splash's interpret-mode kernels spend their time running,
  # not compiling, and lose most under the flags CI's pytest stage compiles with for compile
  # time (.ci/run; README.md, "Tests").
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if f.split("=", 1)[0] not in COMPILE_TIME_FLAGS]
  proc, report = run_suite(tmp_path, "properties.peers.impls:splash_attention", "-n", "2", "-k",
                           "mask_is_exact or hidden_keys_do_not_leak or packed_equals_separate",
                           env={"XLA_FLAGS": " ".join(flags)})
  assert proc.returncode == 0, proc.stdout[-3000:]
  assert report["cases"] >= 10 and _problems(report) == 0


def test_splash_attention_highest_traces_both_directions_at_highest_precision():
  """splash_attention_highest's forward and backward kernels are traced under
  the highest matmul precision (Mosaic's fp32 contract precision on a TPU): on
  a TPU v5e a context around the call alone left the backward, traced when the
  VJP is called, at one bfloat16 pass (docs/PEERS.md)."""
  import jax
  import jax.numpy as jnp
  from properties.peers.impls import splash_attention, splash_attention_highest
  q = jnp.ones((1, 128, 1, 128), jnp.float32)

  def dots(fn):
    grad = jax.grad(lambda q_: fn(q_, q, q, causal=True).sum())
    text = str(jax.make_jaxpr(grad)(q))
    return text.count("dot_general"), text.count("Precision.HIGHEST")

  plain, highest = dots(splash_attention), dots(splash_attention_highest)
  assert plain[0] >= 5 and plain[1] == 0  # forward, dq and dkv kernels' products
  assert highest[0] == plain[0] and highest[1] >= highest[0]  # both operands of each


@pytest.mark.parametrize("tq, tk, options", [
    (5, 300, dict(causal=True, window_len=70, sinks=True)),         # decode-like, GQA 2/1
    (64, 200, dict(causal=True, q_offset=-10)),                    # ten rows without keys
    (20, 150, dict(causal=True, segments=True)),                   # the keys' own ids
    (120, 100, dict(causal=True, window_len=10, q_offset=0)),      # ten rows past the keys
], ids=["window-sinks", "rows-without-keys", "kv-segment-ids", "one-padded-length"])
def test_splash_takes_other_lengths_offsets_the_keys_ids_and_sinks(tq, tk, options):
  """The splash adapter's Tq != Tk, offsets, keys' ids and sinks (interpret
  mode, float32 at highest): out, lse and every gradient, d sinks with lse's
  cotangent, against the reference; a row without keys, which splash leaves
  the mean of v, is the contract's out 0 and lse -inf."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  import ua_reference
  from properties.peers.impls import splash_attention
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(2, tq, 2, 128)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(2, tk, 1 if options.get("sinks") else 2, 128)),
                      jnp.float32) for _ in range(2))
  options = dict(options)
  args = (q, k, v)
  if options.pop("sinks", False):
    args += (jnp.asarray([0.5, -1.0], jnp.float32),)
  if options.pop("segments", False):
    options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, tq))), jnp.int32)
    options["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (2, tk))), jnp.int32)

  def grads(fn):
    def loss(*a):
      out, lse = fn(*a[:3], return_lse=True, **options, **({"sinks": a[3]} if len(a) > 3 else {}))
      weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(out * weights) + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), \
          (out, lse)
    with jax.default_matmul_precision("highest"):
      return jax.grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)

  (got, (out, lse)), (want, (out_r, lse_r)) = grads(splash_attention), \
      grads(ua_reference.attention)
  np.testing.assert_array_equal(np.isfinite(lse), np.isfinite(lse_r))
  if options.get("q_offset") == -10:
    assert np.isneginf(np.asarray(lse)[:, :, :10]).all() and not np.asarray(out)[:, :10].any()
  if tq > tk:  # queries 110 on: their window ends before the first key
    assert np.isneginf(np.asarray(lse)[:, :, 110:]).all() and not np.asarray(out)[:, 110:].any()
  with jax.default_matmul_precision("highest"):  # the call without lse, its own path
    plain = splash_attention(*args[:3], **options, **({"sinks": args[3]} if len(args) > 3 else {}))
  np.testing.assert_allclose(np.asarray(plain), np.asarray(out_r), atol=2e-5, rtol=1e-5)
  finite = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(lse_r)[finite], atol=1e-5)
  for x, y in ((out, out_r), *zip(got, want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-5)
