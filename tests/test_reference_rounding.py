"""The same-precision reference is the oracle's rounding where a cap saturates,
so the bias gate, which measures a kernel against it, does not read a kernel
as close to the oracle as its dtype allows as biased (docs/DEFECTS.md, F61).

jnp.tanh's autodiff derivative is 1 - t^2: in float32, where the cap
saturates, it cancels, and the reference's dq and dk of the H200 case files
below were about one float16 ulp toward zero of the float64 oracle, inside the
gate's 1-ulp filter: the oracle itself, rounded to float16, then measured
+0.5 to +1 ulp "away from zero" and failed the gate."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from properties.judge import bias, runner
from properties.model.case import load_case_file
from ua_reference import caps

CASES = sorted((Path(__file__).parent / "regressions").glob("original-F61-*.json"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem[-1] for p in CASES])
def test_the_oracle_rounded_to_float16_passes_the_bias_gate(path):
  case = load_case_file(path)["case"]
  harness = runner.Harness.of(case)
  oracle, reference = harness.oracle, harness.reference
  stats = {}
  for name in ("dq", "dk", "dv"):
    rounded = np.asarray(oracle[name], np.float64).astype(np.float16)
    stats[name] = bias.stats(rounded, oracle[name], "float16", reference[name])
  verdicts = bias.verdicts(stats, floor=bias.CASE_BIAS_FLOOR_ULPS)
  assert not any(v["biased"] for v in verdicts.values()), verdicts
  assert all(abs(v["mean_ulps"]) < bias.CASE_BIAS_FLOOR_ULPS / 2 for v in verdicts.values()), \
      verdicts


def test_the_tanh_caps_derivative_does_not_cancel_where_they_saturate():
  y = jnp.linspace(-30.0, 30.0, 6001, dtype=jnp.float32)
  exact = 1.0 / np.cosh(np.asarray(y, np.float64)) ** 2
  keep = exact > 1e-30
  autodiff = np.asarray(jax.vmap(jax.grad(caps.tanh_differentiable))(y), np.float64)
  complement = np.asarray(caps._one_minus_square(y, jnp.tanh(y)), np.float64)
  one_minus_square = np.asarray(1.0 - jnp.tanh(y) ** 2, np.float64)
  rel = lambda got: np.max(np.abs(got[keep] - exact[keep]) / exact[keep])
  # y is rounded to float32 (2^-24 relative): 2|y| of that in e = exp(-2|y|).
  assert rel(autodiff) < 3e-6 and rel(complement) < 3e-6
  assert rel(one_minus_square) > 0.5  # the cancellation these replace
  values = np.asarray(caps.tanh_differentiable(y), np.float64)
  np.testing.assert_allclose(values, np.tanh(np.asarray(y, np.float64)), rtol=4e-7, atol=1e-7)
  assert float(jax.grad(caps.tanh_differentiable)(0.0)) == 1.0
