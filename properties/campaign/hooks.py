"""The plugin's session hooks: the time box set up at configure time, the case
records gathered from the test reports, and the report with the campaign's
verdicts written when the session ends (docs/PLUGINS.md)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest

from .options import _check_options
from .report import build_report, skip_reasons, write_report


_RECORD = "ua_case"


_TEST = "test_property"  # the suite's test function (properties/suite.py)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  try:  # before Hypothesis's plugin loads the --hypothesis-profile it was given
    from ..model import profiles
  except ImportError:  # no Hypothesis here: the suite cannot run, other tests can
    pass
  else:
    profiles.register()
  _check_options(config)
  from ..judge import runner
  runner.compile_threads = config.getoption("ua_compile_threads")
  cache = config.getoption("ua_compile_cache")
  if cache:
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    # Every executable, the harness's small ones too: with a threshold a warm campaign
    # compiled most of its executables again (docs/VERIFICATION.md).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  workerinput = getattr(config, "workerinput", None)
  if workerinput is not None and "ua_deadline" in workerinput:
    deadline = workerinput["ua_deadline"]
  else:
    minutes = config.getoption("ua_minutes")
    deadline = None if minutes is None else time.time() + 60 * minutes
  global _SESSION
  _SESSION = config.stash[_STATE] = _State(deadline=deadline, started=time.time())
  _SESSION.config = config


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """pytest-xdist: every worker keeps the controller's time box."""
  node.workerinput["ua_deadline"] = node.config.stash[_STATE].deadline


@dataclasses.dataclass
class _State:
  deadline: float | None
  started: float
  records: list = dataclasses.field(default_factory=list)
  skipped: list = dataclasses.field(default_factory=list)  # the skips' reasons
  config: Any = None
  progress_at: float = 0.0  # when the last progress line was written
  suite_ran: bool = False  # a test of the suite reported in this session
  first_round_started: int = 0  # first-round tests (chunk 0) begun in this process
  # Seconds of the first seed of each configuration this process began
  # (compiling, on the GPU tens of seconds): what a new one is expected to cost.
  first_seeds: list = dataclasses.field(default_factory=list)

  def ends_in_box(self, now: float) -> bool:
    """Whether a new configuration begun now is expected to end before the
    deadline: one begun later ends after it, while every other worker waits
    (docs/VERIFICATION.md, "The box's end")."""
    if not self.first_seeds:
      return True
    return now + statistics.median(self.first_seeds) <= self.deadline


_STATE = pytest.StashKey[_State]()


_SESSION: _State | None = None  # pytest_runtest_logreport gets no config


def pytest_runtest_logreport(report):
  if _SESSION is None:
    return
  if f"::{_TEST}[" in report.nodeid:
    _SESSION.suite_ran = True
    if report.skipped and isinstance(report.longrepr, tuple):
      _SESSION.skipped.append(report.longrepr[2].removeprefix("Skipped: "))
  records = [value for name, value in report.user_properties if name == _RECORD]
  if records and report.when == "call":
    _SESSION.records.extend(records)
    _progress(_SESSION)


PROGRESS_SECONDS = 60.0


def _progress(state: "_State") -> None:
  """A line with the cases run, their failures and the time left in the box,
  at most once a minute, from the process that writes the report."""
  now = time.time()
  if state.config is None or hasattr(state.config, "workerinput") or \
      now - max(state.progress_at, state.started) < PROGRESS_SECONDS:
    return
  state.progress_at = now
  terminal = state.config.pluginmanager.get_plugin("terminalreporter")
  if terminal is None:
    return
  cases = {(r["property"], r["case"]): r["status"] for r in state.records}
  failed = sum(s != "passed" for s in cases.values())
  left = "" if state.deadline is None else \
      f", {max(0.0, state.deadline - now) / 60:.1f} min left in the box"
  terminal.write_line(f"[ua] {len(cases)} cases, {failed} failing, "
                      f"{(now - state.started) / 60:.1f} min{left}")


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (OSError, TypeError, ValueError):
    return False
  return True


def _crashed_cases(failures_dir: str, since: float) -> list[dict]:
  """Case files that this session's dead workers left ``running`` or ``timeout``
  (written since it started, by a process no longer alive)."""
  out = []
  for path in sorted(glob.glob(os.path.join(failures_dir, "*.json"))):
    try:
      if os.path.getmtime(path) < since - 1:
        continue
      with open(path) as f:
        payload = json.load(f)
    except (OSError, ValueError):
      continue
    if not isinstance(payload, dict) or "property" not in payload or _alive(payload.get("pid")):
      continue
    if payload.get("status") in ("running", "timeout"):
      if payload["status"] == "running":
        payload["status"] = "crashed"
        with open(path, "w") as f:
          json.dump(payload, f, indent=1, sort_keys=True)
      out.append({"property": payload["property"], "status": payload["status"],
                  "replay": payload.get("replay", f"ua-repro {path}")})
  return out


def pytest_sessionfinish(session):
  config = session.config
  if hasattr(config, "workerinput") or _STATE not in config.stash:
    return
  state = config.stash[_STATE]
  if not state.suite_ran:
    return
  crashed = _crashed_cases(config.getoption("ua_failures"), state.started)
  if not state.records and not crashed:
    return
  report = build_report(state.records, crashed, time.time() - state.started, state.started)
  report["skipped"] = skip_reasons(state.skipped)
  from ..model import profiles
  report.update(impl=config.getoption("impl"), profile=profiles.active().name,
                host=socket.gethostname(), commit=_commit(), command=" ".join(sys.argv),
                measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                versions=_package_versions())
  if _campaign_gates(config, state.records, report) and session.exitstatus == 0:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
  report["exit_status"] = int(session.exitstatus)
  config.stash[_REPORT] = report
  path = config.getoption("ua_report")
  if path:
    with open(path, "w") as f:
      json.dump(report, f, indent=1, default=str)


_REPORT = pytest.StashKey[dict]()


def _campaign_gates(config, records: list[dict], report: dict) -> bool:
  """Adds the campaign verdicts (gates.py) to ``report``: pooled bias, and the
  comparison with --ua-baseline; writes --ua-save-baseline. True when one
  fails."""
  from ..judge import gates
  report["bias"] = gates.pooled_bias(records)
  failed = any(v["biased"] for v in report["bias"].values())
  baseline = config.getoption("ua_baseline")
  if baseline:
    saved = gates.load_baseline(baseline)
    report["baseline"] = gates.compare_with_baseline(saved, records)
    if gates.same_platform(saved):
      failed |= any(v["regressed"] for v in report["baseline"].values())
    else:
      report["baseline_note"] = gates.platform_note(saved)
  save = config.getoption("ua_save_baseline")
  if save:
    gates.save_baseline(save, records, {"impl": report["impl"], "profile": report["profile"],
                                        "commit": report["commit"], **gates.platform()})
  return failed


def _package_versions() -> dict:
  """The versions a report was made with, read without starting a backend here
  (the controller of a GPU campaign leaves the GPUs to its workers)."""
  import importlib.metadata
  import platform
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "numpy", "hypothesis", "triton"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def _commit() -> str | None:
  """The git commit of the suite's own checkout, which a host's report came
  from, with ``+dirty`` where its files differ from that commit: None where
  this file is not tracked by git (an installed copy, even in a virtualenv
  inside a checkout) or there is no git."""
  here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the properties package
  git = lambda *args: subprocess.run(["git", "-C", here, *args], capture_output=True,
                                     text=True, timeout=10)
  try:
    if git("ls-files", "--error-unmatch", "--",
           os.path.relpath(os.path.abspath(__file__), here)).returncode:
      return None
    out = git("rev-parse", "--short=12", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", here)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode or not out.stdout.strip():
    return None
  # A tree that differs from HEAD did not run HEAD's code: say so.
  return out.stdout.strip() + ("+dirty" if changed.returncode or changed.stdout.strip() else "")


def pytest_terminal_summary(terminalreporter, config):
  report = config.stash.get(_REPORT, None)
  if report is None:
    return
  terminalreporter.section("unified-attention verification")
  write_report(terminalreporter.write, report)
