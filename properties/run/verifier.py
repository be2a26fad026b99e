"""Runs one property on one case, crash-safe, and says how to replay it.

Before a case runs, its case file is written with status ``running``: a case
that kills its process (an illegal address, an abort) or hangs leaves it
behind, and the plugin reports it as a failure with its replay command
(docs/PLUGINS.md). A watchdog ends a case that runs past ``case_timeout``
seconds the same way, after marking its file ``timeout``. A case that passes
removes its file; one that fails keeps it with its errors.

The harness of the case a property judges (the oracle's and the reference's
outputs, the bounds: runner.Harness) is built here once, timed apart from
the implementation's part, and handed to the check. An error raised by the
oracle or the reference is a harness error: recorded and reported as such,
never as a failure of the implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time
import traceback
from typing import Callable

import numpy as np

from ..model.capabilities import Implementation
from ..model.case import Case, write_case_file
from .compile_clock import clock, persistent_cache_on
from ..checks.registry import Property
from ..judge.runner import Harness, HarnessError, prepare, x64
from ..judge.tolerance import OutputError

# Characters of a failure's message kept in its record: the exception and the
# error table of a case; the whole message stays in its case file.
MESSAGE_CHARS = 1500


def failed_output_names(errors, biased=()) -> list[str]:
  """The outputs a failing case names: those past their bound, and
  "<output> (bias)" for each the bias verdict found shifted (bias.py), whose
  elements are all within it."""
  return sorted({e.name for e in errors if not e.ok} | {f"{name} (bias)" for name in biased})


class CaseFailure(AssertionError):
  """A property failed on a case: the implementation is wrong (or raised)."""

  def __init__(self, message: str, case: Case, errors=(), replay: str = "", biased=()):
    super().__init__(message)
    self.case, self.errors, self.replay = case, list(errors), replay
    self.biased = tuple(biased)

  @property
  def failed_outputs(self) -> list[str]:
    return failed_output_names(self.errors, self.biased)


def _exception_message(exc: BaseException) -> str:
  """``Type: message``; for an exception without a message (a bare ``assert``
  in a kernel's own code: splash's mask processing raised one, docs/PEERS.md),
  also where it was raised, the innermost frame's file, line and source."""
  if str(exc):
    return f"{type(exc).__name__}: {exc}"
  frames = traceback.extract_tb(exc.__traceback__)
  if not frames:
    return f"{type(exc).__name__} (no message)"
  last = frames[-1]
  return (f"{type(exc).__name__} (no message), raised at {last.filename}:{last.lineno} "
          f"in {last.name}: {last.line}")


class HarnessFailure(CaseFailure):
  """The oracle or the reference could not evaluate a case (not the implementation)."""


def _remove(path: str) -> None:
  """Removes a passed case's file; another worker running the same case (a
  regression case the strategies also drew) may have removed it first."""
  with contextlib.suppress(FileNotFoundError):
    os.remove(path)


def replay_command(path: str, impl_name: str, imports=()) -> str:
  cmd = f"ua-repro {path} --impl {impl_name}"
  return cmd + (f" --import {','.join(imports)}" if imports else "")


# A case's time limit (docs/VERIFICATION.md, "Crashes, hangs, replay"): the profile's base
# (Profile.case_timeout_base, several times the slowest case seen on its machine) plus a
# second per 1e8 multiply-adds of its attention, B * Hq * T^2 * D
# (the float64 oracle's share at long T); under a time box, no more than the box's
# remainder, BOX_GRACE_SECONDS and that size term.
WORK_PER_SECOND = 1e8
BOX_GRACE_SECONDS = 300.0


def case_timeout(case: Case, base: float, deadline: float | None = None,
                 now: float | None = None) -> float:
  """Seconds after which ``case`` counts as hung: ``base`` plus its size's
  share, and under a time box ending at ``deadline`` (time.time()) at most
  the box's remainder plus BOX_GRACE_SECONDS and that share, so that a hung
  case does not outlive a short box by more than the grace."""
  extra = case.batch * case.num_q_heads * case.seq_len ** 2 * case.head_dim / WORK_PER_SECOND
  seconds = base + extra
  if deadline is not None:
    now = time.time() if now is None else now
    seconds = min(seconds, max(deadline - now, 0.0) + BOX_GRACE_SECONDS + extra)
  return seconds


class _Watchdog:
  """Marks the case file ``timeout`` and ends the process when a case runs too long."""

  def __init__(self, seconds: float | None, on_timeout: Callable[[], None],
               exit_status: int = 70):
    self._timer = None
    if seconds:
      self._timer = threading.Timer(seconds, self._fire, args=(on_timeout, exit_status))
      self._timer.daemon = True
      self._timer.start()

  @staticmethod
  def _fire(on_timeout, exit_status):
    try:
      on_timeout()
    finally:
      os._exit(exit_status)

  def cancel(self):
    if self._timer is not None:
      self._timer.cancel()


@dataclasses.dataclass
class Verifier:
  """Checks properties of one implementation.

  ``record`` receives one dict per case run (the plugin turns them into the
  report); ``imports`` are the modules that register cap methods, for the
  replay command.
  """

  impl: Implementation
  failures_dir: str = "ua-failures"
  imports: tuple[str, ...] = ()
  record: Callable[[dict], None] | None = None
  case_timeout: float | None = None  # seconds; None: case_timeout() of the case's size
  timeout_base: float = 600.0  # case_timeout()'s base (the profile's)
  deadline: float | None = None  # the time box's end (time.time()), if any
  # Writes the watchdog's last words where the user sees them (the plugin's
  # lifts pytest's capture first); None: standard error.
  announce: Callable[[str], None] | None = None
  worker: str = "main"  # the pytest-xdist worker running the checks

  def check(self, prop: Property, case: Case) -> list[OutputError]:
    os.makedirs(self.failures_dir, exist_ok=True)
    path = os.path.join(self.failures_dir, f"{prop.name}-{case.digest()}.json")
    replay = replay_command(path, self.impl.name, self.imports)
    write = lambda status, errors=(), message="": write_case_file(
        path, case, prop.name, self.impl.name, status=status, errors=errors,
        message=message, imports=self.imports, replay=replay)
    write("running")
    start = (time.perf_counter(), clock().mark(), time.time())
    harness_seconds = 0.0
    watchdog = self._watchdog(case, write, replay)
    try:
      if prop.oracle:
        with x64(prop.x64):
          prepare(self.impl, case)  # every executable the check calls, compiled at once
      harness = None
      if prop.takes_harness:  # built once, timed apart from the implementation's part
        harness_start = time.perf_counter()
        harness = Harness.of(prop.judged(case))
        harness_seconds = time.perf_counter() - harness_start
      errors = prop.run(self.impl, case, harness)
      if not errors:
        raise AssertionError(f"{prop.name} compared nothing on this case")
    except HarnessError as exc:
      write("harness", message=str(exc))
      self._record(prop, case, "harness", [], start, replay, str(exc),
                   harness_seconds=harness_seconds)
      raise HarnessFailure(f"harness error (not the implementation's): {prop.name} on {case}\n"
                           f"{exc}\nreplay: {replay}", case, (), replay) from exc
    except Exception as exc:  # noqa: BLE001 -- any failure is a finding
      errors, biased = getattr(exc, "errors", []), getattr(exc, "biased", ())
      message = _exception_message(exc)
      write("failed", [e.to_dict() for e in errors], message)
      self._record(prop, case, "failed", errors, start, replay, message, biased,
                   harness_seconds=harness_seconds)
      raise CaseFailure(f"{prop.name} failed for {self.impl.name} on {case}\n"
                        f"{message}\nreplay: {replay}", case, errors, replay, biased) from exc
    except KeyboardInterrupt:
      # Stopped by the user, perhaps because the case hangs: its file stays.
      message = "interrupted (Ctrl-C) while this case ran"
      write("interrupted", message=message)
      self._record(prop, case, "interrupted", [], start, replay, message,
                   harness_seconds=harness_seconds)
      raise
    finally:
      watchdog.cancel()
    _remove(path)
    self._record(prop, case, "passed", errors, start, "", harness_seconds=harness_seconds)
    return errors

  def _watchdog(self, case: Case, write, replay: str) -> _Watchdog:
    """The case's watchdog, from its start (compiles included: a compile can hang too)."""
    seconds = (case_timeout(case, self.timeout_base, self.deadline)
               if self.case_timeout is None else
               min(self.case_timeout, case_timeout(case, self.case_timeout, self.deadline)))

    def on_timeout():
      message = f"the case ran past its timeout of {seconds:.0f} s (a hang?)"
      write("timeout", message=message)
      text = f"\nua: {message}: {replay}\n"
      if self.announce is not None:
        self.announce(text)
      else:
        sys.stderr.write(text)
        sys.stderr.flush()

    # A worker is replaced (pytest-xdist) and the campaign goes on; a run in one
    # process ends with the failure status, its case file kept.
    return _Watchdog(seconds, on_timeout, 70 if self.worker != "main" else 1)

  def _record(self, prop, case, status, errors, start, replay, message="", biased=(),
              harness_seconds=0.0):
    """One case's record for the report (campaign.report.build_report): its outcome,
    worst error/tolerance overall and per output (None: not finite), and its
    time split into compile_seconds (tracing, lowering and compiling: the
    implementation's callables on a shape's first call, the oracle's and the
    reference's executables; properties/run/compile_clock.py) and run_seconds (the
    rest), with the compilations it needed (and, with JAX's persistent cache
    on, how many of them the cache served); a case that did not pass keeps the
    start of its message, so that a report read away from the machine that ran
    it (its case files stay there) still says what failed. ``started_at`` (the
    wall clock) and ``worker`` place the case on the campaign's timeline, and
    ``harness_seconds`` is the oracle's and the reference's share of its
    seconds (their evaluation and the floors, compiles included)."""
    if self.record is None:
      return
    seconds = time.perf_counter() - start[0]
    timing = clock().since(start[1])
    compile_seconds = min(timing["compile_seconds"], seconds)
    ratios = {}
    for e in errors:  # an output compared twice ("out", "out (plain call)"): its worst
      name = e.name.split(" ")[0]
      ratios[name] = max(ratios.get(name, 0.0), e.ratio)
    finite = lambda r: float(r) if np.isfinite(r) else None
    ratio = max(ratios.values(), default=0.0)
    record = {"property": prop.name, "case": case.digest(),
              "configuration": case.static_digest(), "seq_len": case.seq_len,
              "oracle": prop.oracle,
              "groups": case.groups(), "dtype": case.dtype,
              "bias": {e.name: e.bias for e in errors if e.bias is not None},
              "status": status, "ratio": finite(ratio),
              "ratios": {name: finite(r) for name, r in sorted(ratios.items())},
              "seconds": round(seconds, 3), "compile_seconds": round(compile_seconds, 3),
              "run_seconds": round(seconds - compile_seconds, 3),
              "harness_seconds": round(harness_seconds, 3),
              "started_at": round(start[2], 3),
              "worker": self.worker,
              "compiled": timing["compiled"], "replay": replay,
              "failed_outputs": failed_output_names(errors, biased),
              "config": case.to_dict(), "imports": list(self.imports)}
    if message:
      record["message"] = message[:MESSAGE_CHARS]
    if persistent_cache_on():
      record["cache_hits"] = timing["cache_hits"]
    self.record(record)
