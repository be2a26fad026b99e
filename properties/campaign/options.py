"""The plugin's command-line options and their checks (docs/PLUGINS.md): a bad
value is one usage error before anything runs."""

from __future__ import annotations

import os

import pytest

from ..run.loading import DEFAULT_IMPL, import_modules


def pytest_addoption(parser):
  group = parser.getgroup("unified-attention", "unified-attention verification suite")
  group.addoption("--impl", default=DEFAULT_IMPL,
                  help="implementation under test, as module:function")
  group.addoption("--ua-import", default="",
                  help="comma-separated modules that register cap methods")
  group.addoption("--ua-report", default=None, help="write the JSON report here")
  group.addoption("--ua-failures", default="ua-failures", help="directory of case files")
  group.addoption("--ua-case-timeout", type=float, default=None,
                  help="seconds after which a case counts as hung (ends its worker); default: "
                       "the profile's base plus the case's size share (verifier.case_timeout)")
  group.addoption("--ua-minutes", type=float, default=None,
                  help="time box: no case starts after it (tests not started are skipped)")
  group.addoption("--ua-oracle-chunks", type=int, default=None,
                  help="tests per dtype of each oracle property (default: the profile's); "
                       "more than the profile's run after every other test")
  group.addoption("--ua-database", default=None,
                  help="Hypothesis example database: a directory (default "
                       ".hypothesis/ua-examples) or a Redis URL redis://HOST:PORT/DB "
                       "(joined to the default directory)")
  group.addoption("--ua-shared-database", default=None,
                  help="example database combined with --ua-database: a directory (read "
                       "only) or a Redis URL redis://HOST:PORT/DB (read and written, "
                       "shared by campaigns on several hosts)")
  group.addoption("--ua-compile-cache", default=None,
                  help="directory of JAX's persistent compilation cache")
  group.addoption("--ua-compile-threads", type=int, default=1,
                  help="threads an oracle case's executables (the implementation's VJP and "
                       "plain call, the oracle, the reference) compile on at once")
  group.addoption("--ua-seeds", type=int, default=None,
                  help="input seeds per drawn configuration of an oracle property "
                       "(default: the profile's)")
  group.addoption("--ua-max-examples", type=int, default=None,
                  help="at most this many drawn configurations per test (default: the "
                       "profile's), for a quick run; with --ua-seeds, more cases per compile")
  group.addoption("--ua-save-baseline", default=None,
                  help="write every case's error/tolerance per output here (a baseline)")
  group.addoption("--ua-baseline", default=None,
                  help="fail when errors grew significantly against this baseline's cases")


def _check_options(config):
  """The options' values, checked before anything runs: a report path in a
  missing directory, a failures path that is a file, a negative time box, a
  module that does not import, or (given explicitly) an implementation that
  does not load is one usage error, not a crash at the end of the session or
  a failure of every test."""
  minutes = config.getoption("ua_minutes")
  if minutes is not None and not minutes >= 0:  # 0: a spent box, every test skipped
    raise pytest.UsageError(f"--ua-minutes must be at least 0, got {minutes}")
  for name in ("ua_compile_threads", "ua_seeds", "ua_max_examples"):
    value = config.getoption(name)
    if value is not None and value < 1:
      raise pytest.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
  report = config.getoption("ua_report")
  if report and not os.path.isdir(os.path.dirname(os.path.abspath(report))):
    raise pytest.UsageError(f"--ua-report {report}: no directory "
                            f"{os.path.dirname(os.path.abspath(report))}")
  baseline = config.getoption("ua_baseline")
  if baseline:
    from ..judge.gates import load_baseline
    try:
      load_baseline(baseline)
    except (OSError, ValueError) as exc:
      raise pytest.UsageError(f"--ua-baseline {baseline}: {exc}") from exc
  failures = config.getoption("ua_failures")
  if os.path.exists(failures) and not os.path.isdir(failures):
    raise pytest.UsageError(f"--ua-failures {failures}: exists and is not a directory")
  if _runs_the_suite(config):
    database = config.getoption("ua_database")
    for option, path in (("--ua-failures", failures), ("--ua-report", report),
                         ("--ua-database", database if database and "://" not in database
                          else None)):
      unwritable = path and _unwritable(path)
      if unwritable:
        raise pytest.UsageError(
            f"{option} {path}: {unwritable} is not writable: case files, the report and "
            f"new failures could not be kept (run where you can write, or point "
            f"{option} elsewhere)")
  from .databases import DatabaseOptionError, check_option
  for option in ("ua_database", "ua_shared_database"):
    try:  # a Redis URL: parsed, and the server asked once (by the controller)
      check_option("--" + option.replace("_", "-"), config.getoption(option),
                   connect=not hasattr(config, "workerinput"))
    except DatabaseOptionError as exc:
      raise pytest.UsageError(str(exc)) from None
  names = config.getoption("ua_import")
  try:
    import_modules(names)
  except Exception as exc:  # noqa: BLE001 -- reported as the usage error it is
    raise pytest.UsageError(f"--ua-import {names}: {type(exc).__name__}: {exc}") from exc
  impl = config.getoption("impl")
  if impl != DEFAULT_IMPL and not hasattr(config, "workerinput"):
    from ..model.capabilities import load_impl
    try:
      load_impl(impl)
    except Exception as exc:  # noqa: BLE001 -- as above
      raise pytest.UsageError(f"--impl {impl}: {type(exc).__name__}: {exc}") from exc


def _runs_the_suite(config) -> bool:
  """Whether this session collects the suite (ua-verify, pytest --pyargs
  properties.suite), not only a project's own tests beside the plugin."""
  return any("properties.suite" in str(a) or "properties/suite" in str(a) for a in config.args)


def _unwritable(path: str) -> str | None:
  """The existing directory where ``path`` would be written, if this process
  cannot write there (a read-only file system, permissions); else None."""
  here = os.path.abspath(path)
  if not os.path.isdir(here):
    here = os.path.dirname(here)
  while not os.path.exists(here):
    here = os.path.dirname(here)
  return None if os.access(here, os.W_OK) else here
