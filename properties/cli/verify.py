"""ua-verify: runs the installed suite module (``pytest --pyargs
properties.suite``) through the installed plugin (properties/plugin.py), from
any directory, and prints the verdict (docs/VERIFICATION.md)."""

from __future__ import annotations

import argparse
import json
import os
import time

from ..run.loading import DEFAULT_IMPL, import_modules
from .merge import _check_html, _merge, _write_html
from .verdict import _verdict


# Oracle-property tests per dtype in a time-boxed campaign: more than any box
# reaches, so that no worker runs out of tests before the deadline (the gpu
# profile's own 10 chunks left two GPUs idle for a third of a short box:
# docs/VERIFICATION.md); tests the box does not reach are skipped at no cost.
TIME_BOX_ORACLE_CHUNKS = 100


PROFILE_NAMES = ("ci", "dev", "fuzz", "gpu", "tpu")


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
  error, not a failure per worker."""

  def __init__(self, impl: str):
    self.impl = impl

  def pytest_configure(self, config):
    if hasattr(config, "workerinput"):
      return
    import pytest

    from ..model.capabilities import load_impl
    try:
      load_impl(self.impl)
    except Exception as exc:  # noqa: BLE001 -- reported as the usage error it is
      raise pytest.UsageError(f"--impl {self.impl}: {type(exc).__name__}: {exc}") from exc


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


def _parser() -> argparse.ArgumentParser:
  """ua-verify's options (docs/VERIFICATION.md)."""
  parser = argparse.ArgumentParser(prog="ua-verify", description=verify_main.__doc__)
  parser.add_argument("--impl", default=DEFAULT_IMPL, help="implementation, module:function")
  parser.add_argument("--profile", default="ci", choices=PROFILE_NAMES)
  parser.add_argument("--report", default="ua-report.json", help="JSON report path")
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
  parser.add_argument("--minutes", type=float, default=None,
                      help="time box: tests not started within it are skipped")
  parser.add_argument("--oracle-chunks", type=int, default=None,
                      help="tests per dtype of each oracle property; with --minutes the "
                           f"default is {TIME_BOX_ORACLE_CHUNKS}, more than a box runs, so "
                           "that no worker idles before the deadline")
  parser.add_argument("--case-timeout", type=float, default=None,
                      help="seconds after which a case counts as hung (default: the "
                           "profile's base, 600 or on gpu/tpu 900, plus a second per 1e8 "
                           "multiply-adds of the case; under --minutes at most 300 s past "
                           "the box's end plus that share)")
  parser.add_argument("--failures", default="ua-failures", help="directory of case files")
  parser.add_argument("--database", default=None,
                      help="Hypothesis example database: a directory (default "
                           ".hypothesis/ua-examples) or a Redis URL redis://HOST:PORT/DB")
  parser.add_argument("--shared-database", default=None,
                      help="example database combined with --database: a directory (read "
                           "only) or a Redis URL redis://HOST:PORT/DB (read and written: "
                           "campaigns on several hosts replay each other's failures)")
  parser.add_argument("--merge", nargs="+", metavar="REPORT", default=None,
                      help="run nothing: merge these JSON reports (of several hosts) into "
                           "one, printed and written to --report")
  parser.add_argument("--html", default=None, metavar="FILE",
                      help="also write the report as one self-contained HTML page (needs "
                           "matplotlib: the 'html' extra)")
  parser.add_argument("--html-baseline", default=None, metavar="REPORT",
                      help="with --html: a previous JSON report whose error/tolerance "
                           "distributions the page shows beside this run's")
  parser.add_argument("--compile-cache", default=None,
                      help="JAX persistent compilation cache (gpu profile: .ua-jax-cache)")
  parser.add_argument("--compile-threads", type=int, default=None,
                      help="threads each worker compiles an oracle case's executables on "
                           "(gpu profile: 2; else 1)")
  parser.add_argument("--seeds", type=int, default=None,
                      help="input seeds per drawn configuration of an oracle property "
                           "(default: the profile's)")
  parser.add_argument("--save-baseline", default=None, metavar="FILE",
                      help="write every case's error/tolerance per output to FILE (a "
                           "precision baseline; the ci profile draws the same cases each run)")
  parser.add_argument("--baseline", default=None, metavar="FILE",
                      help="fail when the errors grew significantly against FILE's cases "
                           "(written by --save-baseline)")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
  return parser


def _pytest_args(args) -> list[str]:
  """The pytest command line of a ua-verify run: the installed suite module,
  the profile, and each option that was given, as the plugin's --ua-* option."""
  gpu = args.profile in ("gpu", "tpu")  # a compiled campaign: cache, threads, timeout
  chunks = args.oracle_chunks
  if chunks is None and args.minutes is not None:
    chunks = TIME_BOX_ORACLE_CHUNKS
  timeout = args.case_timeout  # None: the profile's, scaled to each case (verifier.case_timeout)
  cache = args.compile_cache or (".ua-jax-cache" if gpu else None)
  threads = args.compile_threads if args.compile_threads is not None else (2 if gpu else 1)
  # ua-verify runs inside the package whose plugin pytest then loads: pytest's
  # note that it cannot rewrite the already imported package's asserts is moot.
  pytest_args = ["--pyargs", "properties.suite", "-q", "-p", "no:cacheprovider",
                 "-W", "ignore::pytest.PytestAssertRewriteWarning",
                 f"--impl={args.impl}", f"--hypothesis-profile=ua-{args.profile}",
                 f"--ua-report={args.report}", f"--ua-failures={args.failures}",
                 *_worker_args(args), *([] if args.traceback else ["--tb=no"])]
  for flag, value in (("--ua-import", args.imports), ("--ua-minutes", args.minutes),
                      ("--ua-oracle-chunks", chunks),
                      ("--ua-case-timeout", timeout), ("--ua-database", args.database),
                      ("--ua-shared-database", args.shared_database),
                      ("--ua-compile-cache", cache),
                      ("--ua-compile-threads", threads), ("--ua-seeds", args.seeds),
                      ("--ua-save-baseline", args.save_baseline),
                      ("--ua-baseline", args.baseline)):
    if value is not None and value != "":
      pytest_args.append(f"{flag}={value}")
  return pytest_args


def verify_main(argv=None) -> int:
  """ua-verify: runs every property of the suite and prints a report by feature group."""
  parser = _parser()
  args = parser.parse_args(argv)
  if args.minutes is not None and not args.minutes > 0:
    parser.error(f"--minutes must be positive, got {args.minutes:g}")
  report_dir = os.path.dirname(os.path.abspath(args.report))
  if not os.path.isdir(report_dir):
    parser.error(f"--report {args.report}: no directory {report_dir}")
  baseline = _check_html(parser, args)
  if args.merge:
    return _merge(parser, args.merge, args.report, html=(args.html, args.html_baseline, baseline))
  from ..campaign.databases import DatabaseOptionError, check_option
  for option, value in (("--database", args.database),
                        ("--shared-database", args.shared_database)):
    try:
      check_option(option, value)
    except DatabaseOptionError as exc:
      parser.error(str(exc))
  if args.profile == "ci" and (args.database or args.shared_database):
    print("note: the ci profile keeps no example database; --database and "
          "--shared-database take effect with --profile dev, fuzz or gpu")
  if os.path.exists(args.failures) and not os.path.isdir(args.failures):
    parser.error(f"--failures {args.failures}: exists and is not a directory")
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
