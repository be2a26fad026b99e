"""Runs a Case through an implementation, the reference and the oracle.

Executables are compiled ahead of time and cached per (implementation, static
part of the case, flavour, x64), so examples that share a shape bucket, and the
several input seeds of one configuration, reuse them. ``prepare`` compiles the
three an oracle check needs (the implementation's VJP and plain call, one
program; the oracle; the reference) on ``compile_threads`` threads at once:
XLA compiles without the GIL, and on the GPU compiling, not running, is where
a campaign's seconds go (docs/VERIFICATION.md). The oracle (the reference on float64 copies of the
inputs) and the same-precision reference are compiled without XLA's GEMM
autotuning, which dominated their compile time on the GPU, and with its dots on
cuBLAS rather than XLA's Triton GEMM emitter, whose float32 kernels compiled
about 4x as long (both run the dots at HIGHEST precision; cuBLAS sums in
another order, a rounding the reference's error, and so the tolerance, follows).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import threading

import jax
import numpy as np

import ua_reference

from ..model.capabilities import Implementation, declare
from ..model.case import Case
from ..model.inputs import make_inputs, sample_blocks, sampled_rows
from . import sampled
from .error_terms import harness_compiler_options, host_device
from .tolerance import OUTPUTS, OutputError, compare, element_tolerance, floors

REFERENCE = declare("ua_reference:attention", ua_reference.attention)
_MAX_EXECUTABLES = 256
_EXECUTABLES: collections.OrderedDict = collections.OrderedDict()  # key -> compiled, LRU
_EXECUTABLES_LOCK = threading.Lock()
_PREPARED: collections.OrderedDict = collections.OrderedDict()  # configurations prepare() built
# Threads prepare() compiles on (1: none, everything compiles where it is first called).
compile_threads = 1
_POOL: concurrent.futures.ThreadPoolExecutor | None = None


class HarnessError(RuntimeError):
  """The oracle or the reference could not evaluate a case (out of memory, a
  compile failure): the case is unjudged, which is never the implementation's
  failure."""


def x64(enabled: bool):
  """Scoped jax_enable_x64 for this thread alone (jax's thread-local
  ``jax.enable_x64``, on every supported jax), so that prepare's threads can
  compile the float64 oracle beside a 32-bit implementation."""
  return jax.enable_x64(bool(enabled))


def _x64_on() -> bool:
  return bool(jax.config.jax_enable_x64)


def _executable(key, make_fn, args, compiler_options=None, name=None):
  """The compiled executable of ``jax.jit(make_fn())`` on ``args``' shapes,
  built once per key (the key says what the trace depends on). ``name`` names
  the function in jax's compile log (JAX_LOG_COMPILES), where a campaign's
  compile seconds are told apart (docs/VERIFICATION.md, "Where the compile
  seconds go")."""
  key = key + (_x64_on(),)
  with _EXECUTABLES_LOCK:
    executable = _EXECUTABLES.get(key)
    if executable is not None:
      _EXECUTABLES.move_to_end(key)
      return executable
  fn = make_fn()
  if name:
    fn.__name__ = fn.__qualname__ = name
  lowered = jax.jit(fn).lower(*args)
  executable = lowered.compile(compiler_options=compiler_options) if compiler_options \
      else lowered.compile()
  with _EXECUTABLES_LOCK:
    _EXECUTABLES[key] = executable
    while len(_EXECUTABLES) > _MAX_EXECUTABLES:
      _EXECUTABLES.popitem(last=False)
  return executable


class LeakedTracer(TypeError):
  """The implementation kept a value traced in an earlier computation."""


def _call(executable, args):
  """``executable(*args)``. An implementation that caches a value built
  inside an earlier trace (a table made under jit and kept, as a splash
  kernel's mask tables are when the kernel object is cached) leaks that
  tracer into the next compile, which then takes it as an extra input: jax
  reports an arity mismatch here (under a plain jax.jit, UnexpectedTracerError).
  That is the implementation's defect, said as such."""
  try:
    return executable(*args)
  except TypeError as exc:
    if "Computation compiled for" not in str(exc):
      raise
    raise LeakedTracer(
        f"the implementation's computation takes inputs it was not given ({exc}): it "
        f"closes over a value traced in another computation, such as an array built under "
        f"jax.jit (or inside another transformation) and cached for later calls. Build such "
        f"values outside any trace (at import, or under jax.ensure_compile_time_eval()); "
        f"under a plain jax.jit the same code raises UnexpectedTracerError") from exc


def _extra_kwargs(kv_segment_ids, sinks) -> dict:
  """The keys' segment ids and the sinks as keywords, where the case has them:
  an implementation that takes neither is called as before they existed."""
  extra = {} if kv_segment_ids is None else {"kv_segment_ids": kv_segment_ids}
  return extra if sinks is None else dict(extra, sinks=sinks)


def _vjp_fn(impl: Implementation, case: Case, omit=()):
  kwargs = impl.call_kwargs(case)
  for name in omit:
    kwargs.pop(name)
  return_lse = kwargs["return_lse"]

  def run(q, k, v, segment_ids, temperature, dout, dlse, kv_segment_ids=None, sinks=None,
          q_offset=None):
    # ``q_offset``: the case's, traced (a sampled block of the reference's: runner._reference).
    call = kwargs if q_offset is None else dict(kwargs, q_offset=q_offset)

    def f(q, k, v, *sinks_arg):
      extra = _extra_kwargs(kv_segment_ids, sinks_arg[0] if sinks_arg else None)
      return impl.fn(q, k, v, segment_ids=segment_ids, temperature=temperature, **extra,
                     **call)
    primal, vjp = jax.vjp(f, q, k, v, *(() if sinks is None else (sinks,)))
    grads = vjp((dout, dlse) if return_lse else dout)
    out, lse = primal if return_lse else (primal, None)
    result = {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if sinks is not None:
      result["dsinks"] = grads[3]
    return result

  return run


def _forward_fn(impl: Implementation, case: Case):
  kwargs = impl.call_kwargs(case)

  def run(q, k, v, segment_ids, temperature, kv_segment_ids=None, sinks=None):
    result = impl.fn(q, k, v, segment_ids=segment_ids, temperature=temperature,
                     **_extra_kwargs(kv_segment_ids, sinks), **kwargs)
    out, lse = result if kwargs["return_lse"] else (result, None)
    return {"out": out, "lse": lse}

  return run


def _checked_fn(impl: Implementation, case: Case):
  """The VJP and the plain call in one program, as an oracle check calls them:
  compiled apart, a forward the two share (a custom_vjp whose primal and fwd
  rule launch the same kernel) compiled twice (README.md, "Tests")."""
  vjp, forward = _vjp_fn(impl, case), _forward_fn(impl, case)

  def run(q, k, v, segment_ids, temperature, dout, dlse, kv_segment_ids=None, sinks=None):
    plain = forward(q, k, v, segment_ids, temperature, kv_segment_ids, sinks)
    return vjp(q, k, v, segment_ids, temperature, dout, dlse, kv_segment_ids, sinks), plain

  return run


def _vjp_executable(impl: Implementation, case: Case, args, omit=()):
  return _executable(("vjp", impl, case.static_key(), tuple(omit)),
                     lambda: _vjp_fn(impl, case, omit), args, name="implementation_vjp")


def _checked_executable(impl: Implementation, case: Case, args):
  return _executable(("checked", impl, case.static_key()), lambda: _checked_fn(impl, case), args,
                     name="implementation_vjp_and_call")


def _args(inputs: dict, float64: bool):
  """(q, k, v, segment_ids, temperature, dout, dlse, kv_segment_ids, sinks):
  the VJP's arguments, placed with jax.device_put: the dtypes jnp.asarray gives,
  without the identity jnp.asarray compiles per shape on jax 0.10.2."""
  put = jax.device_put
  cast = (lambda x: put(np.asarray(x, np.float64))) if float64 else put
  opt = lambda x: None if x is None else put(x)
  dlse = np.asarray(inputs["dlse"], np.float64 if float64 else np.float32)
  sinks = inputs.get("sinks")
  sinks = None if sinks is None else put(np.asarray(sinks, np.float64 if float64 else np.float32))
  return (cast(inputs["q"]), cast(inputs["k"]), cast(inputs["v"]), opt(inputs["segment_ids"]),
          opt(inputs["temperature"]), cast(inputs["dout"]), put(dlse),
          opt(inputs.get("kv_segment_ids")), sinks)


def _as_numpy(result: dict) -> dict:
  return {n: (None if x is None else np.asarray(x)) for n, x in result.items()}


def evaluate_with_plain_call(impl: Implementation, case: Case, inputs: dict | None = None):
  """(evaluate's outputs and cotangents, a plain call's outputs) from one
  program: what an oracle check compares. The plain call traces no VJP, so a
  custom_vjp computes it through its primal function, not its fwd rule."""
  inputs = make_inputs(case) if inputs is None else inputs
  args = _args(inputs, float64=False)
  result, plain = _call(_checked_executable(impl, case, args), args)
  return _as_numpy(result), _as_numpy(plain)


def evaluate(impl: Implementation, case: Case, inputs: dict | None = None, *,
             omit: tuple[str, ...] = ()):
  """Outputs and q/k/v cotangents of ``impl`` on the case, as numpy arrays;
  ``omit`` drops keyword arguments so defaults can be compared with explicit values."""
  inputs = make_inputs(case) if inputs is None else inputs
  return _as_numpy(evaluate_arrays(impl, case, inputs, omit=omit))


def evaluate_arrays(impl: Implementation, case: Case, inputs: dict, *,
                    omit: tuple[str, ...] = ()) -> dict:
  """evaluate's outputs left on the device that computed them (jax arrays),
  for a check that reduces them there; ``inputs`` may be jax arrays."""
  args = _args(inputs, float64=False)
  return _call(_vjp_executable(impl, case, args, omit), args)


# Where the oracle and the floors run: the host's CPU on a TPU (no native
# float64), else the default device (None).
harness_device = host_device


def reference_x64(float64: bool) -> bool:
  """The x64 mode a reference runs in. On a TPU the same-precision reference
  runs on the chip itself, as the implementation's own dtype runs there
  (float32 products at JAX's default precision), in the user's mode: x64 off
  (the chip's 64-bit integers are emulated). docs/VERIFICATION.md "On a TPU"."""
  return float64 or harness_device() is None


def _reference_args(case: Case, inputs: dict, float64: bool):
  args = _args(inputs, float64)
  device = harness_device() if float64 else None
  if device is not None:
    args = jax.device_put(args, device)
  if not case.return_lse:  # no cotangent on an lse the case ignores
    args = args[:6] + (jax.device_put(np.zeros(args[6].shape, args[6].dtype), device),) + args[7:]
  return args


def _reference_executable(case: Case, args, float64: bool, traced_offset: bool = False):
  """The reference's VJP on ``args``; with ``traced_offset`` the case's q_offset
  is the last argument, not part of the key: the blocks of sampled rows
  (sampled.py), at offsets of their own, share one executable."""
  with_lse = dataclasses.replace(case, return_lse=True, tiles=None)
  keyed = dataclasses.replace(with_lse, q_offset=0) if traced_offset else with_lse
  key = ("reference", keyed.static_key(), float64, traced_offset,
         tuple(None if a is None else np.shape(a) for a in args))
  return _executable(key, lambda: _vjp_fn(REFERENCE, with_lse), args,
                     harness_compiler_options(float64), "oracle_vjp" if float64 else "reference_vjp")


def _reference_call(case: Case, inputs: dict, float64: bool, traced_offset: bool = False):
  """(executable, args) of the reference on ``case``; with ``traced_offset``,
  the case's q_offset passed as an argument."""
  args = _reference_args(case, inputs, float64)
  if traced_offset:
    args = args + (np.asarray(case.q_offset, np.int32),)
  return _reference_executable(case, args, float64, traced_offset), args


def _reference(case: Case, inputs: dict, float64: bool, traced_offset: bool = False):
  """(outputs and cotangents, lse) of the reference; lse is computed even when
  the case does not return it (the floors need it)."""
  executable, args = _reference_call(case, inputs, float64, traced_offset)
  result = _as_numpy(executable(*args))
  lse = result["lse"]
  if not case.return_lse:
    result["lse"] = None
  return result, lse


def prepare(impl: Implementation, case: Case) -> None:
  """Compiles what an oracle check of ``case`` calls, the implementation's VJP
  and plain call (one program) beside the oracle and the reference, on
  ``compile_threads`` threads at once; each in this thread's x64 mode, the
  harness's under x64 as Harness.of runs them. The implementation's also runs
  once there: a Mosaic GPU kernel is built when its executable first runs,
  which JAX's persistent cache does not keep. A compile that fails is left for the check itself to
  meet again, and to report as its own or the harness's failure."""
  if compile_threads <= 1:
    return
  impl_x64 = _x64_on()
  # The further input seeds of a configuration find it prepared: no inputs made
  # and no executable run again for them.
  configuration = (impl, case.static_key(), impl_x64)
  with _EXECUTABLES_LOCK:
    if configuration in _PREPARED:
      return
    _PREPARED[configuration] = None
    while len(_PREPARED) > _MAX_EXECUTABLES:
      _PREPARED.popitem(last=False)
  global _POOL
  if _POOL is None:
    _POOL = concurrent.futures.ThreadPoolExecutor(compile_threads, "ua-compile")
  inputs = make_inputs(case)

  def build(fn, *args, in_x64, run=False):
    with x64(in_x64):
      executable = fn(*args)
      if run:  # a Mosaic GPU kernel builds its module on the first call, not in XLA's compile
        jax.block_until_ready(executable(*args[-1]))
      return executable

  # Sampled rows: blocks of one shape share the reference's executables (the first one's),
  # built with their arguments in build's x64 mode.
  blocks = sample_blocks(case)
  judged = (case, inputs) if blocks is None else sampled.block_call(case, inputs, *blocks[0])
  oracle = lambda: _reference_call(*judged, True, blocks is not None)[0]
  reference = lambda: _reference_call(*judged, False, blocks is not None)[0]
  with x64(impl_x64):
    args = _args(inputs, float64=False)
  jobs = [(_checked_executable, (impl, case, args), impl_x64, True),
          (oracle, (), True, False), (reference, (), reference_x64(False), False)]
  futures = [_POOL.submit(build, fn, *a, in_x64=flag, run=run) for fn, a, flag, run in jobs]
  for future in futures:
    with contextlib.suppress(Exception):
      future.result()


@dataclasses.dataclass(frozen=True, eq=False)
class Harness:
  """What one case is judged against: the float64 oracle's outputs, the
  same-precision reference's, and per output its bound (the reference's error,
  every element's tolerance) and floors (tolerance.floors, before the
  reference's factor). Built once per judged case (``Harness.of``) and handed to
  what scores it: its float64 arrays are GiBs at T = 16k, so it lives as long
  as its judgement holds it, and no cache keeps it or computes it twice."""

  case: Case
  oracle: dict
  reference: dict
  bounds: dict  # output -> (the reference's error, every element's tolerance)
  floors: dict
  # The query rows judged (Case.sampled_rows; sampled.py), None: every row.
  rows: np.ndarray | None = None

  @classmethod
  def of(cls, case: Case) -> Harness:
    """The oracle, the reference and the floors evaluated on ``case`` (on its
    sampled rows, where it samples them).

    Raises HarnessError when any of them cannot be computed.
    """
    inputs = make_inputs(case)
    rows = sampled_rows(case)

    def evaluate_reference(float64):
      if rows is None:
        return _reference(case, inputs, float64)
      return sampled.evaluate_rows(
          case, inputs, lambda c, i: _reference(c, i, float64, traced_offset=True))

    try:
      with x64(True):
        oracle, lse = evaluate_reference(True)
      with x64(reference_x64(False)):
        reference, _ = evaluate_reference(False)
      with x64(True):
        floor = floors(case, inputs, oracle, lse, rows=rows)
    except Exception as exc:  # noqa: BLE001 -- whatever it is, it is the harness's
      raise HarnessError(f"the oracle/reference/floors failed on this case: "
                         f"{type(exc).__name__}: {str(exc)[:2000]}") from exc
    bounds = {name: element_tolerance(name, reference[name], oracle[name], floor[name])
              for name in OUTPUTS if oracle.get(name) is not None}
    return cls(case, oracle, reference, bounds, floor, rows)

  def judged(self, result: dict) -> dict:
    """``result`` at the rows this harness judges (all of it where it judges every row)."""
    return result if self.rows is None else sampled.judged(self.case, self.rows, result)

  def score(self, result: dict, *, slack: float = 1.0, expected: dict | None = None,
            outputs=OUTPUTS) -> list[OutputError]:
    """Errors of ``result`` against the oracle (or ``expected``), per output,
    at the rows the harness judges; against the oracle on sampled rows, also
    the other rows' dq, which must be exactly 0 ("dq (other rows)").

    The bound always scales with the same-precision reference's error on this
    case, so metamorphic comparisons share the equivalence test's model.
    """
    against_oracle = expected is None
    expected = self.oracle if expected is None else self.judged(expected)
    full, result = result, self.judged(result)
    errors = []
    for name in outputs:
      if result.get(name) is None or expected.get(name) is None or name not in self.bounds:
        continue
      ref_err, tol = self.bounds[name]
      errors.append(compare(name, result[name], expected[name], ref_err, tol, slack=slack))
    if against_oracle and self.rows is not None and "dq" in outputs:
      errors += sampled.other_rows_dq(self.case, full.get("dq"))
    return errors
