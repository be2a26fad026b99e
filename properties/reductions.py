"""Large outputs reduced where they are computed: the accelerator, not the host.

An oracle case at T = 16k has outputs of tens of millions of elements; scoring
them in float64 numpy on the host (the comparison, the tolerance, the bias
counts) took 12 of the 18 seconds of such a case on the H200, the
implementation and the float64 oracle about one (docs/VERIFICATION.md,
"Comparisons on the device"). Each function here reduces in one jitted float64
pass to the scalars its numpy counterpart (tolerance.compare,
tolerance.element_tolerance, bias.BiasStats.of of bias.signed_ulps) reduces
to, with the same elementwise IEEE arithmetic: the same values, only sums in
another order. tests/test_reductions.py holds the two paths to each other.
Small outputs stay on the host: a jitted reduction compiles per shape, which
the many small configurations of a CPU run would each pay.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

# From this many elements on, an output is reduced on an accelerator (numpy
# took about 26 ns an element per comparison on the H200's host, 27 ms at 2^20;
# the jitted reductions compile once per shape, for all the seeds of a
# configuration).
DEVICE_ELEMENTS = 1 << 20
_forced = False


def wanted(*arrays) -> bool:
  """Whether arrays of these sizes are reduced on the device: on an accelerator
  backend, from DEVICE_ELEMENTS elements (any but an empty one under ``forced``)."""
  size = max((int(np.size(a)) for a in arrays if a is not None), default=0)
  if _forced or not size:
    return bool(size)
  return size >= DEVICE_ELEMENTS and jax.default_backend() != "cpu"


@contextlib.contextmanager
def forced():
  """Every reduction on the device, whatever its size and backend (tests, on a CPU)."""
  global _forced
  before, _forced = _forced, True
  try:
    yield
  finally:
    _forced = before


def _on_device(fn):
  """``fn`` jitted and called under x64 (its arithmetic is float64), on device
  copies of numpy arguments; returns its scalars as Python numbers."""
  jitted = jax.jit(fn)

  @functools.wraps(fn)
  def call(*args):
    with jax.enable_x64(True):
      out = jitted(*(jnp.asarray(a) for a in args))
      return tuple(x.item() for x in jax.device_get(out))

  return call


def _f64(x):
  return x.astype(jnp.float64)


@_on_device
def compare_terms(impl, expected, tolerance, slack, limit):
  """tolerance.compare's reductions: (largest error, NaN count, non-finite
  mismatches, flat index of the largest error/tolerance, the error and the
  tolerance there)."""
  impl, expected = _f64(impl), _f64(expected)
  # Materialized: fused into |expected| + tol below, XLA may contract the
  # product and the sum into one FMA, one rounding where numpy has two.
  tol = jax.lax.optimization_barrier(
      jnp.broadcast_to(_f64(slack) * _f64(tolerance), expected.shape))
  finite = jnp.isfinite(expected)
  overflow = finite & (jnp.abs(expected) + tol >= limit) & jnp.isinf(impl) & \
      (jnp.sign(impl) == jnp.sign(expected))
  nan_count = jnp.sum(jnp.isnan(impl))
  inf_mismatch = (jnp.sum(jnp.isinf(impl) & finite & ~overflow)
                  + jnp.sum(~finite & ~jnp.isnan(impl) & (impl != expected)))
  diff = jnp.where(finite & jnp.isfinite(impl), jnp.abs(impl - expected), 0.0)
  ratio = jnp.where(diff == 0, 0.0, diff / tol).reshape(-1)
  # numpy's argmax: the first NaN if any (a reduction on a GPU may meet a later
  # one first), else the first largest.
  nan = jnp.isnan(ratio)
  worst = jnp.where(jnp.any(nan), jnp.argmax(nan), jnp.argmax(jnp.where(nan, -jnp.inf, ratio)))
  return (jnp.max(diff, initial=0.0), nan_count, inf_mismatch, worst,
          diff.reshape(-1)[worst], tol.reshape(-1)[worst])


@_on_device
def tolerance_terms(ref, oracle, floor):
  """tolerance.element_tolerance's reductions: (the reference's largest error,
  its largest error in units of the floor, its largest error where the floor
  is 0)."""
  ref, oracle = _f64(ref), _f64(oracle)
  finite = jnp.isfinite(oracle) & jnp.isfinite(ref)
  err = jnp.where(finite, jnp.abs(ref - oracle), 0.0)
  floor = jnp.broadcast_to(_f64(floor), err.shape)
  rho = jnp.max(jnp.where(floor > 0, err / floor, 0.0), initial=0.0)
  unfloored = jnp.max(jnp.where(floor > 0, 0.0, err), initial=0.0)
  return jnp.max(err, initial=0.0), rho, unfloored


def _power_of_two(exponent):
  """2.0 ** exponent, exactly, from its bits (jnp.ldexp multiplies by a
  power that a GPU's pow need not round exactly); below float64's normal range,
  as a normal power times 2^-64."""
  bits = lambda e: jax.lax.bitcast_convert_type(
      (jnp.clip(e, -1022, 1023).astype(jnp.int64) + 1023) << 52, jnp.float64)
  return jnp.where(exponent >= -1022, bits(exponent), bits(exponent + 64) * 2.0 ** -64)


@_on_device
def bias_terms(got, oracle, reference, min_exponent, significand, within, dead_zone):
  """bias.BiasStats.of(bias.signed_ulps(...))'s fields: (n, above, below,
  total, squares, rows_above, rows_below)."""
  oracle = _f64(oracle)
  got, reference = _f64(got).reshape(oracle.shape), _f64(reference).reshape(oracle.shape)
  keep = jnp.isfinite(oracle) & (oracle != 0) & jnp.isfinite(got) & jnp.isfinite(reference)
  exponent = jnp.maximum(jnp.frexp(jnp.abs(oracle))[1] - 1, min_exponent)
  ulp = _power_of_two(exponent - significand)
  keep &= jnp.abs(reference - oracle) <= within * ulp
  ulps = jnp.where(keep, (got - reference) * jnp.sign(oracle) / ulp, jnp.nan)
  rows = ulps.reshape(-1, ulps.shape[-1]) if ulps.ndim >= 2 else ulps.reshape(-1, 1)
  measured = jnp.isfinite(rows)
  clipped = jnp.where(measured, jnp.clip(rows, -1.0, 1.0), 0.0)
  counts = jnp.sum(measured, axis=1)
  row_mean = jnp.where(counts > 0, jnp.sum(clipped, axis=1) / jnp.maximum(counts, 1), 0.0)
  return (jnp.sum(measured), jnp.sum(measured & (rows > dead_zone)),
          jnp.sum(measured & (rows < -dead_zone)), jnp.sum(clipped), jnp.sum(clipped ** 2),
          jnp.sum(row_mean > dead_zone), jnp.sum(row_mean < -dead_zone))
