"""runner.prepare: the executables an oracle check calls, compiled at once on threads."""

import dataclasses

import pytest

from properties.checks import checks

from properties.judge import runner
from properties.model.capabilities import declare
from properties.model.case import Case

import ua_reference

# The contract's reference, declared under another name so that its executables
# are keyed apart from the harness's own.
IMPL = declare("tests.test_runner:reference_as_impl", ua_reference.attention)
CASE = Case(batch=1, seq_len=33, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="bfloat16",
            causal=True, segments="packed", cap_method="tanh", cap_params=(2.0,),
            return_lse=True, temperature="uniform", seed=3)


@pytest.fixture
def threads(monkeypatch):
  monkeypatch.setattr(runner, "compile_threads", 4)


@pytest.mark.parametrize("x64", [False, True])
def test_prepare_compiles_everything_the_check_calls(threads, x64):
  case = dataclasses.replace(CASE, head_dim=16 + 8 * x64)
  with runner.x64(x64):
    before = set(runner._EXECUTABLES)
    runner.prepare(IMPL, case)
    prepared = set(runner._EXECUTABLES) - before
    errors = checks.matches_oracle(IMPL, case)
    assert set(runner._EXECUTABLES) - before == prepared
  # the implementation's VJP and plain call (one program), the oracle and the reference
  assert len(prepared) == 3
  assert {key[-1] for key in prepared if key[0] == "checked"} == {x64}
  assert errors and all(e.ok for e in errors)


def test_prepare_leaves_a_failing_compile_to_the_check(threads):
  def broken(q, k, v, **kwargs):
    raise TypeError("this implementation cannot trace")
  impl = declare("tests.test_runner:broken", broken)
  runner.prepare(impl, CASE)  # does not raise: the check meets the error and reports it
  with pytest.raises(TypeError, match="cannot trace"):
    checks.matches_oracle(impl, CASE)


def test_x64_is_scoped_to_the_thread():
  import threading

  import jax
  seen = []
  with runner.x64(True):
    thread = threading.Thread(target=lambda: seen.append(bool(jax.config.jax_enable_x64)))
    thread.start()
    thread.join()
    assert jax.config.jax_enable_x64
  assert seen == [False]


def test_a_prepared_configuration_is_not_prepared_again(threads, monkeypatch):
  """The further input seeds of a configuration make no inputs and run nothing in prepare."""
  case = dataclasses.replace(CASE, head_dim=32)
  runner.prepare(IMPL, case)
  made = []
  monkeypatch.setattr(runner, "make_inputs", lambda c: made.append(c))
  runner.prepare(IMPL, dataclasses.replace(case, seed=case.seed + 1))
  assert made == []


def test_on_a_tpu_the_float64_work_runs_on_the_host_cpu(monkeypatch):
  """A TPU has no native float64: the oracle's inputs, the floors' terms and
  the comparisons' reductions are placed on the host's CPU there; the
  same-precision reference runs on the chip in the user's mode (x64 off), as
  the implementation's dtype runs there. Elsewhere nothing moves."""
  import jax
  import numpy as np
  from properties.judge import error_terms, reductions, runner
  from properties.model.case import Case
  from properties.model.inputs import make_inputs
  case = Case(batch=1, seq_len=8, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="float32", seed=1)
  assert runner.harness_device() is None and runner.reference_x64(False)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  cpu = jax.devices("cpu")[0]
  assert error_terms.host_device() == cpu
  args = runner._reference_args(case, make_inputs(case), float64=True)
  assert all(a.devices() == {cpu} for a in args if a is not None)
  assert runner.reference_x64(True) and not runner.reference_x64(False)
  assert not reductions.wanted(np.zeros(reductions.DEVICE_ELEMENTS))

def test_the_tpu_harness_gives_the_cpu_harness_bounds(monkeypatch):
  """The harness's TPU path (the floors' terms jitted on the host, the
  comparisons in numpy, the reference in x64-off mode) gives the tolerances
  of the CPU path, up to the order of float64 sums."""
  import jax
  import numpy as np
  from properties.judge import runner
  from properties.model.case import Case
  case = Case(batch=1, seq_len=40, num_q_heads=2, num_kv_heads=1, head_dim=16,
              dtype="float32", causal=True, seed=3, cap_method="tanh", cap_params=(5.0,))
  on_cpu = runner.Harness.of(case).bounds
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  on_tpu = runner.Harness.of(case).bounds
  assert set(on_cpu) == set(on_tpu) and on_cpu
  for name, (ref_err, tol) in on_cpu.items():
    assert on_tpu[name][0] == ref_err, name  # the same reference arithmetic on a CPU
    np.testing.assert_allclose(on_tpu[name][1], tol, rtol=1e-9, err_msg=name)


def test_the_tpu_profile_runs_in_one_process():
  import argparse
  from properties.cli import verify
  from properties.model.profiles import PROFILES
  args = argparse.Namespace(profile="tpu", gpus=0, workers="auto", minutes=8.0)
  assert verify._worker_args(args) == []
  buckets = PROFILES["tpu"].buckets
  assert buckets.max_seq_len == 65536 and 65536 in buckets.long_seq_lens
  assert (buckets.sampled_rows, buckets.sampled_from) == (256, 4096)  # the host's oracle
  assert {128, 256} <= set(buckets.head_dims)


def test_a_failure_without_a_message_says_where_it_was_raised(tmp_path):
  # splash's mask processing raised a bare AssertionError on a mask with no visible key, and
  # the report read "AssertionError: " (docs/PEERS.md).
  from properties.checks.registry import get
  from properties.run.verifier import CaseFailure, Verifier

  def bare_assert(q, k, v, **kwargs):  # a bare assert, as pytest leaves other modules'
    raise AssertionError
  impl = declare("tests.test_runner:bare_assert", bare_assert)
  with pytest.raises(CaseFailure, match=r"AssertionError \(no message\), raised at "
                     r".*test_runner\.py:\d+ in bare_assert: raise AssertionError"):
    Verifier(impl, str(tmp_path)).check(get("matches_oracle"), CASE)
