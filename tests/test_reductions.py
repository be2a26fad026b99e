"""The device's reductions of large outputs (properties.judge.reductions) give the
host's verdicts: the same error, tolerance, worst element and counts, on
values with every special case a comparison meets (NaN, inf of either sign,
overflow to inf, exact zeros, zero tolerances, ties)."""

import dataclasses

import numpy as np
import pytest

from properties.judge import reductions
from properties.judge.bias import signed_ulps, stats
from properties.model.capabilities import load_impl
from properties.model.case import Case
from properties.checks.checks import matches_oracle
from properties.judge.runner import Harness
from properties.judge.tolerance import compare, element_tolerance


def _values(seed: int, shape=(3, 40, 2, 16)):
  rng = np.random.default_rng(seed)
  expected = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
  got = expected + rng.standard_normal(shape) * np.abs(expected) * 2.0 ** -9
  flat_e, flat_g = expected.reshape(-1), got.reshape(-1)
  idx = rng.permutation(flat_e.size)[:60]
  flat_g[idx[:5]] = np.nan
  flat_g[idx[5:10]] = np.inf
  flat_g[idx[10:15]] = -np.inf
  flat_e[idx[15:20]] = -np.inf                      # an lse of a row with no key
  flat_g[idx[15:17]] = -np.inf
  flat_e[idx[20:25]] = 7e4                           # beyond float16's range ...
  flat_g[idx[20:25]] = np.inf                        # ... where inf is correct
  flat_e[idx[25:30]] = 0.0
  flat_g[idx[30:40]] = flat_e[idx[30:40]]            # exact
  tol = np.abs(expected) * 2.0 ** -8
  tol.reshape(-1)[idx[40:45]] = 0.0
  tol.reshape(-1)[idx[45:50]] = np.nan
  return got, expected, tol


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("slack", [1.0, 2.0, 0.0])
def test_compare_on_the_device_is_the_hosts(seed, slack):
  got, expected, tol = _values(seed)
  with np.errstate(over="ignore"):
    got16 = got.astype(np.float16)
  for impl, tolerance in ((got, tol), (got16, tol), (got, 1e-3), (got, 0.0),
                          (got, np.where(np.isnan(tol), 1.0, tol))):
    host = compare("dq", impl, expected, 0.5, tolerance, slack=slack)
    with reductions.forced():
      device = compare("dq", impl, expected, 0.5, tolerance, slack=slack)
    np.testing.assert_equal(dataclasses.asdict(device), dataclasses.asdict(host))
  assert host.nan_count == 5 and host.inf_mismatch > 0


def test_an_empty_output_compares_on_either_side():
  empty = np.zeros((2, 0, 3))
  host = compare("out", empty, empty, 0.0, 1.0)
  with reductions.forced():
    np.testing.assert_equal(dataclasses.asdict(compare("out", empty, empty, 0.0, 1.0)),
                            dataclasses.asdict(host))


@pytest.mark.parametrize("seed", range(4))
def test_element_tolerance_on_the_device_is_the_hosts(seed):
  ref, oracle, floor = _values(seed)
  floor = np.abs(floor)
  floor.reshape(-1)[::7] = 0.0
  for f in (floor, np.float64(1e-3), np.zeros_like(floor)):
    err, tol = element_tolerance("dk", ref, oracle, f)
    with reductions.forced():
      err_d, tol_d = element_tolerance("dk", ref, oracle, f)
    assert err_d == err
    np.testing.assert_array_equal(tol_d, tol)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("seed", range(3))
def test_bias_counts_on_the_device_are_the_hosts(dtype, seed):
  _, oracle, _ = _values(seed, (4, 33, 2, 8))
  rng = np.random.default_rng(seed + 10)
  oracle.reshape(-1)[:40] = np.ldexp(1.0, rng.integers(-20, 20, 40))  # powers of two
  oracle.reshape(-1)[40:80] = np.nextafter(oracle.reshape(-1)[:40], 0)  # just below them
  ulp = np.ldexp(1.0, np.frexp(np.abs(oracle))[1] - 1 - {"bfloat16": 7, "float16": 10,
                                                          "float32": 23}[dtype])
  reference = oracle + np.round(rng.standard_normal(oracle.shape)) * ulp * 0.5
  got = reference + np.round(rng.standard_normal(oracle.shape) * 2) * ulp * 0.25 - 0.1 * ulp
  for shape in (oracle.shape, (oracle.size,)):
    args = (got.reshape(shape), oracle.reshape(shape), dtype, reference.reshape(shape))
    host = stats(*args)
    with reductions.forced():
      device = stats(*args)
    counts = ("n", "above", "below", "rows_above", "rows_below")
    assert [getattr(device, c) for c in counts] == [getattr(host, c) for c in counts]
    assert device.total == pytest.approx(host.total, rel=1e-12, abs=1e-9)
    assert device.squares == pytest.approx(host.squares, rel=1e-12, abs=1e-9)
  assert 0 < host.above and 0 < host.below


def test_a_value_just_below_a_power_of_two_is_measured_in_its_own_binade():
  """frexp, not a rounded log2: 2^5 (1 - 2^-53) is in [16, 32), where a
  bfloat16 ulp is 2^-3; log2 rounds it to 5 and would measure in 2^-2."""
  oracle = np.array([np.nextafter(32.0, 0.0)])
  assert signed_ulps(oracle + 2.0 ** -3, oracle, "bfloat16")[0] == pytest.approx(1.0)


def test_only_large_outputs_on_an_accelerator_are_reduced_on_the_device(monkeypatch):
  large, small = np.zeros(reductions.DEVICE_ELEMENTS), np.zeros(reductions.DEVICE_ELEMENTS - 1)
  monkeypatch.setattr(reductions.jax, "default_backend", lambda: "gpu")
  assert reductions.wanted(large) and reductions.wanted(small, large)
  assert not reductions.wanted(small) and not reductions.wanted(None)
  monkeypatch.setattr(reductions.jax, "default_backend", lambda: "cpu")
  assert not reductions.wanted(large)
  with reductions.forced():
    assert reductions.wanted(np.zeros(3)) and not reductions.wanted(np.zeros((2, 0)))


def test_a_power_of_two_is_built_exactly_across_float64s_range():
  """Its normal range: XLA on a CPU flushes float64 subnormals to zero (a GPU
  does not: only float32 has a flush-to-zero mode there), and only a float64
  output's ulps fall below it."""
  import functools

  import jax
  import jax.numpy as jnp
  exponents = np.arange(-1022, 1024)
  with jax.enable_x64(True):
    built = np.asarray(jax.jit(functools.partial(reductions.power_of_two, jnp))(exponents))
  np.testing.assert_array_equal(built, reductions.power_of_two(np, exponents))


def test_an_oracle_case_scores_the_same_reduced_on_the_device():
  impl = load_impl("ua_reference:attention")
  case = Case(batch=2, seq_len=33, num_q_heads=4, num_kv_heads=2, head_dim=16,
              dtype="bfloat16", causal=True, cap_method="tanh", cap_params=(3.0,),
              return_lse=True, seed=5)
  harness = Harness.of(case)  # one harness: the comparisons' reductions are what differs
  host = matches_oracle(impl, case, harness)
  with reductions.forced():
    device = matches_oracle(impl, case, harness)
  assert [e.name for e in device] == [e.name for e in host]
  for d, h in zip(device, host):
    assert (d.max_abs_err, d.ref_err, d.tolerance, d.worst_index, d.error, d.nan_count,
            d.inf_mismatch) == (h.max_abs_err, h.ref_err, h.tolerance, h.worst_index, h.error,
                                h.nan_count, h.inf_mismatch)
    if h.bias is not None:
      assert {k: v for k, v in d.bias.items() if k not in ("total", "squares")} == \
          {k: v for k, v in h.bias.items() if k not in ("total", "squares")}
