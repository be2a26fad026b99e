"""runner.prepare: the executables an oracle check calls, compiled at once on threads."""

import dataclasses

import pytest

from properties import checks, runner
from properties.capabilities import declare
from properties.case import Case

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
  # the implementation's VJP and plain call, the oracle and the reference
  assert len(prepared) == 4
  assert {key[-1] for key in prepared if key[0] in ("vjp", "forward")} == {x64}
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
