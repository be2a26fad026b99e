"""Large outputs reduced where they are computed: the accelerator, not the host.

An oracle case at T = 16k has outputs of tens of millions of elements; scoring
them in float64 numpy on the host (the comparison, the tolerance, the bias
counts) took most of such a case's time on the H200, far more than the
implementation and the float64 oracle (docs/VERIFICATION.md,
"Comparisons on the device"). Those reductions are written once, as functions
of an array module ``xp`` (as properties/judge/error_terms.py's terms are), and
``reduce`` runs them jitted in float64 on the device for a large output, in
numpy on the host otherwise: the same elementwise IEEE arithmetic, only sums
in another order. tests/test_reductions.py holds the two to each other. Small
outputs stay on the host: a jitted reduction compiles per shape, which the
many small configurations of a CPU run would each pay.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np

# From this many elements on, an output is reduced on an accelerator: numpy's
# comparisons on the host grow with the output, and the jitted reductions compile
# once per shape, for all the seeds of a configuration.
DEVICE_ELEMENTS = 1 << 20
_forced = False


def wanted(*arrays) -> bool:
  """Whether arrays of these sizes are reduced on the device: on an accelerator
  backend, from DEVICE_ELEMENTS elements (any but an empty one under ``forced``)."""
  size = max((int(np.size(a)) for a in arrays if a is not None), default=0)
  if _forced or not size:
    return bool(size)
  # Not on a TPU: its float64 is emulated, and frexp's under x64 does not compile there.
  return size >= DEVICE_ELEMENTS and jax.default_backend() not in ("cpu", "tpu")


@contextlib.contextmanager
def forced():
  """Every reduction on the device, whatever its size and backend (tests, on a CPU)."""
  global _forced
  before, _forced = _forced, True
  try:
    yield
  finally:
    _forced = before


def reduce(fn, *args) -> tuple:
  """``fn(xp, *args)``'s scalars as Python numbers: jitted, under x64, on
  device copies of the arguments when they are large (``wanted``); numpy on
  the host otherwise (its NaN and overflow warnings silenced: they are the
  values a comparison is for)."""
  if wanted(*args):
    with jax.enable_x64(True):
      out = jax.device_get(_jitted(fn)(*(jnp.asarray(a) for a in args)))
  else:
    with np.errstate(all="ignore"):
      out = fn(np, *args)
  return tuple(np.asarray(x).item() for x in out)


@functools.lru_cache(maxsize=None)
def _jitted(fn):
  return jax.jit(functools.partial(fn, jnp))


def float64(xp, x):
  return xp.asarray(x).astype(xp.float64)


def materialized(xp, x):
  """``x`` computed on its own on the device: fused into a sum, XLA may
  contract a product and the sum into one FMA, one rounding where numpy has
  two."""
  return jax.lax.optimization_barrier(x) if xp is jnp else x


def power_of_two(xp, exponent):
  """2.0 ** exponent, exactly: on the device from its bits (jnp.ldexp
  multiplies by a power that a GPU's pow need not round exactly), below
  float64's normal range as a normal power times 2^-64."""
  if xp is np:
    return np.ldexp(1.0, exponent)
  bits = lambda e: jax.lax.bitcast_convert_type(
      (jnp.clip(e, -1022, 1023).astype(jnp.int64) + 1023) << 52, jnp.float64)
  return jnp.where(exponent >= -1022, bits(exponent), bits(exponent + 64) * 2.0 ** -64)


def first_argmax(xp, x):
  """numpy's argmax of a 1-D ``x``: the first NaN if any (a reduction on a GPU
  may meet a later one first), else the first largest."""
  nan = xp.isnan(x)
  return xp.where(xp.any(nan), xp.argmax(nan), xp.argmax(xp.where(nan, -xp.inf, x)))
