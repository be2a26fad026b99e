"""The oracle on sampled query rows (properties/judge/sampled.py) and the
activation-like inputs (properties/model/inputs.py), on shapes small enough for
a dense oracle to check them: the sampled oracle is the dense one at its rows,
an implementation's defect on a judged row fails, and the rows it does not
judge must carry dq of exactly 0."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import outside_kernels
import ua_kernels
import ua_reference
from properties.checks import checks
from properties.checks.checks import PropertyFailure
from properties.judge.runner import Harness
from properties.model import inputs as inputs_module
from properties.model.capabilities import declare, load_impl
from properties.model.case import Case
from properties.model.inputs import ACTIVATION_LIKE, make_inputs, sampled_rows

BASE = Case(batch=2, seq_len=97, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16",
            seed=3, sampled_rows=32)
CONFIGS = {
    "causal": dict(causal=True),
    "window and documents": dict(window_len=20, segments="packed"),
    "more keys, sinks, temperature": dict(kv_seq_len=150, causal=True, sinks="normal",
                                          temperature="uniform"),
    "an offset, key ids, lse": dict(q_offset=-5, kv_seq_len=80, causal=True,
                                    segments="packed", return_lse=True),
    "z-loss": dict(z_loss_weight=0.1, causal=True, return_lse=True),
}


def test_the_rows_are_blocks_first_and_last_included():
  rows = sampled_rows(BASE)
  assert len(rows) == 32 and np.all(np.diff(rows) > 0)
  assert rows[0] == 0 and rows[-1] == BASE.seq_len - 1
  assert np.array_equal(rows, sampled_rows(BASE))  # from the seed alone
  assert not np.array_equal(rows, sampled_rows(dataclasses.replace(BASE, seed=4)))
  assert sampled_rows(dataclasses.replace(BASE, seq_len=32)) is None  # no fewer rows than asked
  assert sampled_rows(dataclasses.replace(BASE, sampled_rows=0)) is None


def _dense_harness_of_the_same_inputs(case, monkeypatch):
  """The dense harness of ``case``'s inputs (their cotangents zero off the sampled rows)."""
  drawn = make_inputs(case)
  inputs_module._drawn.cache_clear()
  monkeypatch.setattr(inputs_module, "_draw", lambda _: dict(drawn))
  try:
    return Harness.of(dataclasses.replace(case, sampled_rows=0))
  finally:
    inputs_module._drawn.cache_clear()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_sampled_oracle_is_the_dense_one_at_its_rows(name, monkeypatch):
  case = dataclasses.replace(BASE, **CONFIGS[name])
  sampled = Harness.of(case)
  dense = _dense_harness_of_the_same_inputs(case, monkeypatch)
  judged = 0
  for output, want in dense.oracle.items():
    got = sampled.oracle.get(output)
    if want is None or got is None:
      # Under a z-loss every row has an lse cotangent: the key gradients go unjudged.
      assert got is None and (want is None or (case.z_loss_weight and output in ("dk", "dv")))
      continue
    judged += 1
    want = sampled.judged({output: want})[output]
    finite = np.isfinite(want)
    assert np.array_equal(finite, np.isfinite(got))
    diff = np.subtract(got, want, where=finite, out=np.zeros_like(got))
    assert np.max(np.abs(diff), initial=0) <= 1e-12 * max(
        1.0, np.max(np.abs(want), where=finite, initial=0)), output
    floor, dense_floor = sampled.floors[output], sampled.judged({output: dense.floors[output]})[
        output]
    # Key outputs' floors drop the rows of zero cotangent, whose ds is exactly 0: what
    # they held was a flushed probability's allowance, below 1e-5 of any floor here.
    assert np.all(floor <= dense_floor * (1 + 1e-12)), output
    assert np.all(floor >= dense_floor * (1 - 1e-5)), output
  assert judged >= 3


def _perturbed(where, row=None):
  """The reference with out's last row moved by 1% ("out"), or dq of ``row``
  (not a sampled one) given 1e-3 of the other rows' cotangents' sum ("dq")."""
  def fn(q, k, v, **kwargs):
    result = ua_reference.attention(q, k, v, **kwargs)
    out = result[0] if isinstance(result, tuple) else result
    if where == "out":
      out = out.at[:, -1].multiply(1.01)
    else:
      tie = 1e-3 * jnp.sum(q[:, row])
      out = out + (tie - jax.lax.stop_gradient(tie)).astype(out.dtype)
    return (out,) + tuple(result[1:]) if isinstance(result, tuple) else out
  return declare(f"tests.test_sampled_oracle:perturbed_{where}", fn)


def test_the_sampled_rows_pass_the_reference_and_fail_a_defect_on_them():
  case = dataclasses.replace(BASE, causal=True, dtype="float32")
  other = int(np.setdiff1d(np.arange(case.seq_len), sampled_rows(case))[0])
  errors = checks.matches_oracle(declare("ua_reference:attention", ua_reference.attention),
                                 case)
  assert {e.name for e in errors} >= {"out", "dq", "dk", "dv", "dq (other rows)"}
  with pytest.raises(PropertyFailure, match=r"\bout\b"):
    checks.matches_oracle(_perturbed("out"), case)
  with pytest.raises(PropertyFailure, match=r"dq \(other rows\)"):
    checks.matches_oracle(_perturbed("dq", other), case)


@pytest.mark.parametrize("distribution", ACTIVATION_LIKE)
def test_activation_like_inputs_have_their_shape(distribution):
  case = Case(batch=1, seq_len=400, num_q_heads=2, num_kv_heads=2, head_dim=64,
              dtype="float32", distribution=distribution, seed=5)
  k = np.asarray(make_inputs(case)["k"], np.float64)
  if distribution == "outliers":
    rms = np.sqrt(np.mean(k ** 2, axis=(0, 1, 2)))
    assert 1 <= np.sum(rms > 30 * np.median(rms)) <= 3
  elif distribution == "correlated":
    walk = k - k.mean(axis=1, keepdims=True)
    lag = np.sum(walk[:, 1:] * walk[:, :-1]) / np.sum(walk * walk)
    assert lag > 0.9
  else:
    kurtosis = np.mean(k ** 4) / np.mean(k ** 2) ** 2
    assert kurtosis > 5  # a normal's is 3


@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
@pytest.mark.parametrize("distribution", ACTIVATION_LIKE)
def test_the_kernels_match_the_oracle_on_activation_like_inputs(distribution, dtype):
  case = Case(batch=1, seq_len=97, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype,
              causal=True, return_lse=True, distribution=distribution, tiles=(16, 16),
              seed=7, sampled_rows=32)
  errors = checks.matches_oracle(load_impl("ua_kernels:attention"), case)
  assert all(e.ok for e in errors)


def test_the_planted_int32_offsets_are_exact_below_2_31_elements_and_wrap_past():
  case = Case(batch=1, seq_len=40, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="bfloat16", causal=True, seed=2)
  drawn = make_inputs(case)
  q, k, v = (jnp.asarray(drawn[n]) for n in ("q", "k", "v"))
  planted = outside_kernels.int32_offsets_attention(q, k, v, causal=True)
  expected = ua_kernels.attention(q, k, v, causal=True)
  assert np.array_equal(np.asarray(planted), np.asarray(expected))
  # Its last offset at the scale profile's long shape (1, 262400, 32, 256), in int32 as it is
  # computed there, is negative: past 2^31 elements the offsets wrap.
  b, t, h, d = (jnp.int32(n - 1) for n in (1, 262400, 32, 256))
  last = ((b * jnp.int32(262400) + t) * jnp.int32(32) + h) * jnp.int32(256) + d
  assert int(last) < 0


def test_only_checks_that_judge_sampled_rows_draw_them():
  from properties.checks.registry import BY_NAME, Property
  sampled = dataclasses.replace(BASE, segments="packed")
  assert not BY_NAME["packed_equals_separate"].draws(sampled)  # slices bounds by documents
  assert BY_NAME["packed_equals_separate"].draws(dataclasses.replace(sampled, sampled_rows=0))
  assert BY_NAME["matches_oracle"].draws(sampled)
  assert BY_NAME["deterministic"].draws(sampled)  # no harness
  registered = Property("a_users_check", checks.matches_oracle, 1)  # opts in, or draws none
  assert not registered.draws(sampled)


@pytest.mark.parametrize("name", ["huge_tanh_cap_is_no_cap", "gqa_equals_repeated_heads",
                                  "key_blocks_merge_to_one_call", "sink_is_an_extra_key"])
def test_metamorphic_checks_judge_sampled_rows(name, tmp_path):
  from properties.checks.registry import BY_NAME
  from properties.run.verifier import Verifier
  prop = BY_NAME[name]
  case = dataclasses.replace(BASE, dtype="float32", return_lse=True, causal=True,
                             cap_method="tanh" if name.startswith("huge") else "none",
                             cap_params=(5.0,) if name.startswith("huge") else (),
                             sinks="normal" if name.startswith("sink") else "none")
  assert prop.draws(case) and sampled_rows(case) is not None
  impl = declare("tests.test_sampled_oracle:reference", ua_reference.attention)
  errors = Verifier(impl, str(tmp_path)).check(prop, case)
  assert errors and all(e.ok for e in errors)


def test_every_block_of_every_seed_runs_one_compiled_reference():
  # The blocks sit at offsets of their own, traced: one oracle and one same-precision
  # reference per configuration, not one per block and input seed.
  from properties.judge import runner
  case = dataclasses.replace(BASE, causal=True, seq_len=90, seed=21)
  before = {key for key in runner._EXECUTABLES if key[0] == "reference"}
  for seed in (21, 22):
    Harness.of(dataclasses.replace(case, seed=seed))
  built = {key for key in runner._EXECUTABLES if key[0] == "reference"} - before
  assert len(built) == 2, built


def test_prepare_compiles_the_blocks_reference_the_harness_runs(monkeypatch):
  from properties.judge import runner
  monkeypatch.setattr(runner, "compile_threads", 2)
  case = dataclasses.replace(BASE, causal=True, seq_len=91, dtype="float32", seed=5)
  impl = declare("tests.test_sampled_oracle:prepared", ua_reference.attention)
  runner.prepare(impl, case)
  prepared = set(runner._EXECUTABLES)
  checks.matches_oracle(impl, case)
  assert set(runner._EXECUTABLES) == prepared  # nothing compiled after prepare
