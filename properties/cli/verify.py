"""ua-verify: runs the installed suite module (``pytest --pyargs
properties.suite``) through the installed plugin (properties/plugin.py), from
any directory, and prints the verdict (docs/VERIFICATION.md)."""

from __future__ import annotations

import argparse
import json
import os
import time

from ..campaign.option_table import OPTIONS
from ..run.loading import import_modules
from .merge import _check_html, _merge, _write_html
from .verdict import _verdict


# Oracle-property tests per dtype in a time-boxed campaign: more than any box
# reaches, so that no worker runs out of tests before the deadline (the gpu
# profile's own 10 chunks left two GPUs idle for a third of a short box:
# docs/VERIFICATION.md); tests the box does not reach are skipped at no cost.
TIME_BOX_ORACLE_CHUNKS = 100


PROFILE_NAMES = ("ci", "dev", "fuzz", "gpu", "tpu", "scale")


def _worker_args(args) -> list[str]:
  """pytest-xdist arguments: ``--gpus N`` gives each GPU its own group of
  workers, each pinned with CUDA_VISIBLE_DEVICES before it imports jax and
  holding a share of its GPU's memory; else ``-n``. Under a time box, workers
  take tests two, then one at a time (``--maxschedchunk 1``; xdist's default
  hands each worker a quarter of its share at once), so that the first round
  of property_tests spreads over all workers."""
  if getattr(args, "profile", None) == "tpu":
    return []  # one program at a time holds a TPU chip: no xdist workers there
  if args.gpus:
    per_gpu = args.workers_per_gpu or max(1, (os.cpu_count() or 8) // args.gpus)
    env = ("//env:XLA_PYTHON_CLIENT_PREALLOCATE=false"
           f"//env:XLA_PYTHON_CLIENT_MEM_FRACTION={0.9 / per_gpu:.3f}")
    out = []
    for gpu in range(args.gpus):
      out += ["--tx", f"{per_gpu}*popen//env:CUDA_VISIBLE_DEVICES={gpu}{env}"]
    out += ["--dist", "load", "--max-worker-restart", "1000"]
  elif args.workers in ("0", 0):
    return []
  else:
    out = ["-n", str(args.workers), "--max-worker-restart", "1000"]
  if args.minutes is not None and _xdist_has_maxschedchunk():
    out += ["--maxschedchunk", "1"]
  return out


def _xdist_has_maxschedchunk() -> bool:
  """Whether the installed pytest-xdist takes --maxschedchunk (3.2 and later)."""
  import importlib.metadata
  try:
    major, minor = (int(part) for part in
                    importlib.metadata.version("pytest-xdist").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return False
  return (major, minor) >= (3, 2)


class _CheckImpl:
  """Loads --impl once in the controlling process, inside pytest (so that its
  modules import after pytest's own set-up): a bad name is one clear usage
  error, not a failure per worker. The plugin checks an --impl other than the
  default the same way; this checks the default too, as ua-verify always runs
  the suite on it."""

  def __init__(self, impl: str):
    self.impl = impl

  def pytest_configure(self, config):
    if hasattr(config, "workerinput"):
      return
    from ..campaign.options import check_impl
    check_impl(self.impl)


def _precheck_imported_caps(parser, imports: str) -> str | None:
  """The cap methods ``--import`` registers, checked against their own
  declarations (derivative, bounds, homogeneity: cap_checks.precheck) before
  any case runs: a wrong derivative is named in seconds, not read off dq/dk
  out of tolerance."""
  if not imports:
    return None
  from ua_reference.caps import CAP_METHODS
  before = set(CAP_METHODS)
  try:
    import_modules(imports)
  except Exception as exc:  # noqa: BLE001 -- a usage error
    parser.error(f"--import {imports}: {type(exc).__name__}: {exc}")
  from ..checks.cap_checks import precheck
  for name in sorted(set(CAP_METHODS) - before):
    found = precheck(name)
    if found:
      return f"cap method {name!r} (registered by --import {imports}) contradicts " \
             f"itself: {found}"
  return None


# ua-verify's own defaults of some shared options, overriding the table's
# (the plugin keeps those): dest -> (the parser's default, what its help adds).
# None: _profile_defaults picks the value by profile and time box.
VERIFY_DEFAULTS = {
    "report": ("ua-report.json", "default: ua-report.json"),
    "oracle_chunks": (None, f"with --minutes the default is {TIME_BOX_ORACLE_CHUNKS}, more "
                            "than a box runs, so that no worker idles before the deadline"),
    "compile_cache": (None, "gpu and tpu profiles: .ua-jax-cache"),
    "compile_threads": (None, "gpu and tpu profiles: 2; else 1"),
}


def _parser() -> argparse.ArgumentParser:
  """ua-verify's options (docs/VERIFICATION.md): its own, then the suite's
  (option_table.OPTIONS, the plugin's --ua-NAME as --NAME)."""
  parser = argparse.ArgumentParser(prog="ua-verify", description=verify_main.__doc__)
  parser.add_argument("--profile", default="ci", choices=PROFILE_NAMES)
  parser.add_argument("-n", "--workers", default="auto",
                      help="pytest-xdist workers: 'auto' (the default, one per CPU core) or "
                           "a number ('0' for none, one process); ignored with --gpus")
  parser.add_argument("--partial", action="store_true",
                      help="with --minutes: PASS on the cases that ran even when the box "
                           "ended before every declared feature had one (else INCOMPLETE, "
                           "exit status 3)")
  parser.add_argument("--traceback", action="store_true",
                      help="print pytest's tracebacks of failing tests (through the suite's "
                           "internals); by default the report's failure blocks say it all")
  parser.add_argument("--gpus", type=int, default=0,
                      help="spread the workers over this many GPUs (one group per GPU)")
  parser.add_argument("--workers-per-gpu", type=int, default=None,
                      help="workers on each GPU (default: the host's CPU cores over --gpus, "
                           "as workers spend most of their time compiling)")
  parser.add_argument("--merge", nargs="+", metavar="REPORT", default=None,
                      help="run nothing: merge these JSON reports (of several hosts) into "
                           "one, printed and written to --report")
  parser.add_argument("--html", default=None, metavar="FILE",
                      help="also write the report as one self-contained HTML page (needs "
                           "matplotlib: the 'html' extra)")
  parser.add_argument("--html-baseline", default=None, metavar="REPORT",
                      help="with --html: a previous JSON report whose error/tolerance "
                           "distributions the page shows beside this run's")
  shared = parser.add_argument_group("the suite's options (pytest: --ua-NAME, --impl)")
  for option in OPTIONS:
    if not option.in_verify:
      continue
    default, note = _verify_default(option)
    extra = {"type": option.type} if option.type is not str else {}
    if option.metavar:
      extra["metavar"] = option.metavar
    shared.add_argument(option.verify_flag, dest=option.dest, default=default,
                        help=option.help_for(plugin=False) + (f" ({note})" if note else ""),
                        **extra)
  parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
  return parser


def _verify_default(option) -> tuple:
  """(ua-verify's default of a shared option, what its help adds of it)."""
  return VERIFY_DEFAULTS.get(option.dest, (option.default, None))


def _profile_defaults(args) -> dict:
  """ua-verify's values of the shared options it leaves to the profile and
  the time box (VERIFY_DEFAULTS), where they are not given."""
  gpu = args.profile in ("gpu", "tpu", "scale")  # a compiled campaign: cache, threads
  out = {"compile_threads": 2 if gpu else 1}
  if args.minutes is not None:
    out["oracle_chunks"] = TIME_BOX_ORACLE_CHUNKS
  if gpu:
    out["compile_cache"] = ".ua-jax-cache"
  return out


def _pytest_args(args) -> list[str]:
  """The pytest command line of a ua-verify run: the installed suite module,
  the profile, and each shared option that has a value, as the plugin's
  --ua-NAME (a given one, else ua-verify's default)."""
  defaults = _profile_defaults(args)
  # ua-verify runs inside the package whose plugin pytest then loads: pytest's
  # note that it cannot rewrite the already imported package's asserts is moot.
  pytest_args = ["--pyargs", "properties.suite", "-q", "-p", "no:cacheprovider",
                 "-W", "ignore::pytest.PytestAssertRewriteWarning",
                 f"--hypothesis-profile=ua-{args.profile}"]
  for option in OPTIONS:
    if not option.in_verify:
      continue
    value = getattr(args, option.dest)
    if value is None or value == "":
      value = defaults.get(option.dest, value)
    # An empty value means "not given", but where the default is a path or a
    # name (--impl, --report, --failures) it goes on as given.
    if value is not None and (value != "" or _verify_default(option)[0]):
      pytest_args.append(f"{option.plugin_flag}={value}")
  return pytest_args + _worker_args(args) + ([] if args.traceback else ["--tb=no"])


def _check_shared(parser, args, names=None) -> None:
  """The shared options' checks (option_table), as the plugin runs them but
  named as given here: a usage error (status 2) before pytest starts."""
  for option in OPTIONS:
    if option.in_verify and (names is None or option.dest in names):
      problem = option.problem(getattr(args, option.dest), plugin=False)
      if problem:
        parser.error(problem)


def verify_main(argv=None) -> int:
  """ua-verify: runs every property of the suite and prints a report by feature group."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.minutes is not None and not args.minutes > 0:  # stricter than the plugin's 0
    parser.error(f"--minutes must be positive, got {args.minutes:g}")
  _check_shared(parser, args, ("report",))  # --merge writes it too
  baseline = _check_html(parser, args)
  if args.merge:
    return _merge(parser, args.merge, args.report, html=(args.html, args.html_baseline, baseline))
  _check_shared(parser, args)
  if args.profile == "ci" and (args.database or args.shared_database):
    print("note: the ci profile keeps no example database; --database and "
          "--shared-database take effect with --profile dev, fuzz or gpu")
  contradiction = _precheck_imported_caps(parser, args.imports)
  if contradiction:
    print(f"FAIL: {contradiction}")
    return 1
  import pytest

  pytest_args = _pytest_args(args)
  if os.path.exists(args.report):
    os.remove(args.report)
  start = time.time()
  code = pytest.main(pytest_args + args.pytest_args, plugins=[_CheckImpl(args.impl)])
  report = {}
  if os.path.exists(args.report):
    with open(args.report) as f:
      report = json.load(f)
  verdict, exit_code, notes = _verdict(code, report, args)
  written = f"report written to {args.report}" if report else "no report (nothing ran)"
  for note in notes:
    print(f"\n{note}")
  print(f"\n{verdict}: {args.impl}, profile {args.profile}, {report.get('cases', 0)} cases "
        f"in {time.time() - start:.0f} s; {written}")
  if args.html and report:
    _write_html(args.html, report, args.html_baseline, baseline)
  elif args.html:
    print(f"no HTML page: no report to show ({args.html} not written)")
  return exit_code
