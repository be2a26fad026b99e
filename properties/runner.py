"""Runs a Case through an implementation, the reference and the oracle.

Compiled callables are cached per (implementation, static part of the case,
flavour), so Hypothesis examples that share a shape bucket reuse them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import ua_reference
from ua_kernels import KernelConfig

from .case import Case
from .inputs import make_inputs
from .tolerance import OUTPUTS, OutputError, compare, floors, reference_error


@contextlib.contextmanager
def x64(enabled: bool):
  """Scoped jax_enable_x64 on both supported jax versions."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def call_kwargs(case: Case) -> dict:
  """The contract's static keyword arguments for this case."""
  config = None if case.blocks is None else KernelConfig(*case.blocks)
  return dict(causal=case.causal, window_len=case.window_len,
              cap_method=case.cap_method, cap_params=case.cap_params,
              sm_scale=case.sm_scale, z_loss_weight=case.z_loss_weight,
              return_lse=case.return_lse, config=config)


def _static_key(case: Case):
  d = dataclasses.asdict(case)
  d.pop("seed")
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in d.items()))


@functools.lru_cache(maxsize=256)
def _compiled(impl, static_key, omit=()):
  kwargs = call_kwargs(Case(**dict(static_key)))
  for name in omit:
    kwargs.pop(name)
  return_lse = kwargs["return_lse"]

  def run(q, k, v, segment_ids, temperature, dout, dlse):
    def f(q, k, v):
      return impl(q, k, v, segment_ids=segment_ids, temperature=temperature, **kwargs)
    primal, vjp = jax.vjp(f, q, k, v)
    if return_lse:
      out, lse = primal
      dq, dk, dv = vjp((dout, dlse))
    else:
      out, lse = primal, None
      dq, dk, dv = vjp(dout)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}

  return jax.jit(run)


@functools.lru_cache(maxsize=256)
def _compiled_forward(impl, static_key):
  kwargs = call_kwargs(Case(**dict(static_key)))

  def run(q, k, v, segment_ids, temperature):
    result = impl(q, k, v, segment_ids=segment_ids, temperature=temperature, **kwargs)
    out, lse = result if kwargs["return_lse"] else (result, None)
    return {"out": out, "lse": lse}

  return jax.jit(run)


def evaluate_forward(impl, case: Case, inputs: dict | None = None, *, float64: bool = False):
  """Outputs of a plain call (no VJP traced), which a custom_vjp computes
  through its primal function rather than its fwd rule."""
  inputs = make_inputs(case) if inputs is None else inputs
  as_float = lambda x: np.asarray(x, np.float64) if float64 else x
  args = [None if inputs[n] is None else jnp.asarray(as_float(inputs[n]) if n in "qkv" else inputs[n])
          for n in ("q", "k", "v", "segment_ids", "temperature")]
  result = _compiled_forward(impl, _static_key(case))(*args)
  return {n: (None if x is None else np.asarray(x)) for n, x in result.items()}


def evaluate(impl, case: Case, inputs: dict | None = None, *, float64: bool = False,
             omit: tuple[str, ...] = ()):
  """Outputs and q/k/v cotangents of ``impl`` on the case, as numpy arrays.

  ``float64`` runs on float64 copies of the inputs (the oracle); ``omit``
  drops keyword arguments so defaults can be compared with explicit values.
  """
  inputs = make_inputs(case) if inputs is None else inputs
  cast = (lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))) \
      if float64 else (lambda x: None if x is None else jnp.asarray(x))
  args = [cast(inputs[n]) for n in ("q", "k", "v")]
  seg = None if inputs["segment_ids"] is None else jnp.asarray(inputs["segment_ids"])
  temp = None if inputs["temperature"] is None else jnp.asarray(inputs["temperature"])
  dlse = jnp.asarray(np.asarray(inputs["dlse"], np.float64 if float64 else np.float32))
  key = _static_key(case)
  result = _compiled(impl, key, omit)(*args, seg, temp, cast(inputs["dout"]), dlse)
  return {n: (None if x is None else np.asarray(x)) for n, x in result.items()}


@functools.lru_cache(maxsize=64)
def baseline(case: Case):
  """Oracle results, and per output (the reference's error, the floor)."""
  inputs = make_inputs(case)
  with x64(True):
    oracle = evaluate(ua_reference.attention, case, inputs, float64=True)
    ref = evaluate(ua_reference.attention, case, inputs)
    lse = oracle["lse"]
    if lse is None:  # the z-loss/recomputation floors need |lse| even if not returned
      lse = evaluate_forward(ua_reference.attention, dataclasses.replace(case, return_lse=True),
                             inputs, float64=True)["lse"]
  floor = floors(case, inputs, oracle, float(np.max(np.abs(lse[np.isfinite(lse)]), initial=0.0)))
  bounds = {name: (reference_error(ref[name], oracle[name]), floor[name])
            for name in OUTPUTS if oracle.get(name) is not None}
  return oracle, bounds


def score(case: Case, result: dict, *, slack: float = 1.0, expected: dict | None = None,
          outputs=OUTPUTS) -> list[OutputError]:
  """Errors of ``result`` against the oracle (or ``expected``), per output.

  The bound always scales with the same-precision reference's error on this
  case, so metamorphic comparisons share the equivalence test's model.
  """
  oracle, bounds = baseline(case)
  expected = oracle if expected is None else expected
  errors = []
  for name in outputs:
    if result.get(name) is None or expected.get(name) is None or name not in bounds:
      continue
    ref_err, floor = bounds[name]
    errors.append(compare(name, result[name], expected[name], ref_err, floor, slack=slack))
  return errors
