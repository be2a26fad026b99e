"""Runs a Case through an implementation, the reference and the oracle.

Compiled callables are cached per (implementation, static part of the case,
flavour), so examples that share a shape bucket, and the several input seeds
of one configuration, reuse them. The oracle (the reference on float64 copies
of the inputs) and the same-precision reference are compiled without XLA's
GEMM autotuning: it does not change what they compute, and it dominated
their compile time on the GPU (docs/VERIFICATION.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import ua_reference

from .capabilities import Implementation, declare
from .case import Case
from .inputs import make_inputs
from .tolerance import OUTPUTS, OutputError, compare, floors, reference_error

REFERENCE = declare("ua_reference:attention", ua_reference.attention)
# Per-compile options of the oracle and the reference (not of the implementation).
_HARNESS_COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0}
_REFERENCE_EXECUTABLES: dict = {}  # (static key, float64, shapes) -> executable


class HarnessError(RuntimeError):
  """The oracle or the reference could not evaluate a case (out of memory, a
  compile failure): the case is unjudged, which is never the implementation's
  failure."""


@contextlib.contextmanager
def x64(enabled: bool):
  """Scoped jax_enable_x64 on both supported jax versions."""
  previous = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", enabled)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", previous)


def _vjp_fn(impl: Implementation, case: Case, omit=()):
  kwargs = impl.call_kwargs(case)
  for name in omit:
    kwargs.pop(name)
  return_lse = kwargs["return_lse"]

  def run(q, k, v, segment_ids, temperature, dout, dlse):
    def f(q, k, v):
      return impl.fn(q, k, v, segment_ids=segment_ids, temperature=temperature, **kwargs)
    primal, vjp = jax.vjp(f, q, k, v)
    if return_lse:
      out, lse = primal
      dq, dk, dv = vjp((dout, dlse))
    else:
      out, lse = primal, None
      dq, dk, dv = vjp(dout)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}

  return run


@functools.lru_cache(maxsize=256)
def _compiled(impl: Implementation, static_key, omit=()):
  return jax.jit(_vjp_fn(impl, Case(*static_key), omit))


@functools.lru_cache(maxsize=256)
def _compiled_forward(impl: Implementation, static_key):
  kwargs = impl.call_kwargs(Case(*static_key))

  def run(q, k, v, segment_ids, temperature):
    result = impl.fn(q, k, v, segment_ids=segment_ids, temperature=temperature, **kwargs)
    out, lse = result if kwargs["return_lse"] else (result, None)
    return {"out": out, "lse": lse}

  return jax.jit(run)


def _args(inputs: dict, float64: bool):
  cast = (lambda x: jnp.asarray(np.asarray(x, np.float64))) if float64 else jnp.asarray
  opt = lambda x: None if x is None else jnp.asarray(x)
  dlse = np.asarray(inputs["dlse"], np.float64 if float64 else np.float32)
  return (cast(inputs["q"]), cast(inputs["k"]), cast(inputs["v"]), opt(inputs["segment_ids"]),
          opt(inputs["temperature"]), cast(inputs["dout"]), jnp.asarray(dlse))


def _as_numpy(result: dict) -> dict:
  return {n: (None if x is None else np.asarray(x)) for n, x in result.items()}


def evaluate_forward(impl: Implementation, case: Case, inputs: dict | None = None):
  """Outputs of a plain call (no VJP traced), which a custom_vjp computes
  through its primal function rather than its fwd rule."""
  inputs = make_inputs(case) if inputs is None else inputs
  args = _args(inputs, float64=False)[:5]
  return _as_numpy(_compiled_forward(impl, case.static_key())(*args))


def evaluate(impl: Implementation, case: Case, inputs: dict | None = None, *,
             omit: tuple[str, ...] = ()):
  """Outputs and q/k/v cotangents of ``impl`` on the case, as numpy arrays;
  ``omit`` drops keyword arguments so defaults can be compared with explicit values."""
  inputs = make_inputs(case) if inputs is None else inputs
  return _as_numpy(_compiled(impl, case.static_key(), omit)(*_args(inputs, float64=False)))


def _reference(case: Case, inputs: dict, float64: bool):
  """(outputs and cotangents, lse) of the reference; lse is computed even when
  the case does not return it (the floors need it)."""
  with_lse = dataclasses.replace(case, return_lse=True, tiles=None)
  args = _args(inputs, float64)
  if not case.return_lse:
    args = args[:6] + (jnp.zeros_like(args[6]),)  # no cotangent on an lse the case ignores
  key = (with_lse.static_key(), float64, tuple(None if a is None else a.shape for a in args))
  executable = _REFERENCE_EXECUTABLES.get(key)
  if executable is None:
    lowered = jax.jit(_vjp_fn(REFERENCE, with_lse)).lower(*args)
    executable = lowered.compile(compiler_options=_HARNESS_COMPILER_OPTIONS)
    if len(_REFERENCE_EXECUTABLES) >= 64:
      _REFERENCE_EXECUTABLES.pop(next(iter(_REFERENCE_EXECUTABLES)))
    _REFERENCE_EXECUTABLES[key] = executable
  result = _as_numpy(executable(*args))
  lse = result["lse"]
  if not case.return_lse:
    result["lse"] = None
  return result, lse


def baseline(case: Case):
  """Oracle results, and per output (the reference's error, the floor).

  Raises HarnessError when either cannot be computed.
  """
  oracle, _, bounds = _harness(case)
  return oracle, bounds


def reference_result(case: Case) -> dict:
  """The same-precision reference's outputs on the case (computed with the
  baseline, not again)."""
  return _harness(case)[1]


@functools.lru_cache(maxsize=4)  # float64 results of T=16k cases are GiBs
def _harness(case: Case):
  """(oracle, same-precision reference, bounds) of baseline."""
  inputs = make_inputs(case)
  try:
    with x64(True):
      oracle, lse = _reference(case, inputs, float64=True)
      ref, _ = _reference(case, inputs, float64=False)
  except Exception as exc:  # noqa: BLE001 -- whatever it is, it is the harness's
    raise HarnessError(f"the oracle/reference failed on this case: "
                       f"{type(exc).__name__}: {str(exc)[:2000]}") from exc
  floor = floors(case, inputs, oracle, float(np.max(np.abs(lse[np.isfinite(lse)]), initial=0.0)))
  bounds = {name: (reference_error(ref[name], oracle[name]), floor[name])
            for name in OUTPUTS if oracle.get(name) is not None}
  return oracle, ref, bounds


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
