"""The plugin's command-line options (declared in option_table.py, shared with
ua-verify) and their checks (docs/PLUGINS.md): a bad value is one usage error
before anything runs."""

from __future__ import annotations

import os

import pytest

from ..run.loading import DEFAULT_IMPL, import_modules
from .option_table import OPTIONS


def pytest_addoption(parser):
  """The table's options, each as --ua-NAME (--impl as itself)."""
  group = parser.getgroup("unified-attention", "unified-attention verification suite")
  for option in OPTIONS:
    extra = {"type": option.type} if option.type is not str else {}
    if option.metavar:
      extra["metavar"] = option.metavar
    group.addoption(option.plugin_flag, default=option.default,
                    help=option.help_for(plugin=True), **extra)


def _check_options(config):
  """The options' values, checked before anything runs: a report path in a
  missing directory, a failures path that is a file, a negative time box (the
  table's checks, which ua-verify runs too), a module that does not import, or
  (given explicitly) an implementation that does not load is one usage error,
  not a crash at the end of the session or a failure of every test."""
  controller = not hasattr(config, "workerinput")
  if controller:  # a worker's options are the controller's, checked already
    for option in OPTIONS:  # each as the table says (ua-verify runs the same)
      problem = option.problem(config.getoption(option.plugin_dest), plugin=True)
      if problem:
        raise pytest.UsageError(problem)
  if _runs_the_suite(config):
    database = config.getoption("ua_database")
    for option, path in (("--ua-failures", config.getoption("ua_failures")),
                         ("--ua-report", config.getoption("ua_report")),
                         ("--ua-database", database if database and "://" not in database
                          else None)):
      unwritable = path and _unwritable(path)
      if unwritable:
        raise pytest.UsageError(
            f"{option} {path}: {unwritable} is not writable: case files, the report and "
            f"new failures could not be kept (run where you can write, or point "
            f"{option} elsewhere)")
  names = config.getoption("ua_import")
  try:  # in every process: the modules register cap methods where cases run
    import_modules(names)
  except Exception as exc:  # noqa: BLE001 -- reported as the usage error it is
    raise pytest.UsageError(f"--ua-import {names}: {type(exc).__name__}: {exc}") from exc
  impl = config.getoption("impl")
  if impl != DEFAULT_IMPL and controller:
    check_impl(impl)


def check_impl(impl: str) -> None:
  """Loads ``impl`` (inside pytest, after its set-up): one usage error naming
  it, not a failure per test or per worker."""
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
