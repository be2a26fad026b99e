"""Command-line entry points: ua-verify, ua-repro, ua-fuzz.

They work from an installed package in any directory: ua-verify runs the
installed suite module (``pytest --pyargs properties.suite``) through the
installed plugin (properties/plugin.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .loading import DEFAULT_IMPL, import_modules

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

    from .capabilities import load_impl
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
  from .cap_checks import precheck
  for name in sorted(set(CAP_METHODS) - before):
    found = precheck(name)
    if found:
      return f"cap method {name!r} (registered by --import {imports}) contradicts " \
             f"itself: {found}"
  return None


def verify_main(argv=None) -> int:
  """ua-verify: runs every property of the suite and prints a report by feature group."""
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
  args = parser.parse_args(argv)
  if args.minutes is not None and not args.minutes > 0:
    parser.error(f"--minutes must be positive, got {args.minutes:g}")
  report_dir = os.path.dirname(os.path.abspath(args.report))
  if not os.path.isdir(report_dir):
    parser.error(f"--report {args.report}: no directory {report_dir}")
  baseline = _check_html(parser, args)
  if args.merge:
    return _merge(parser, args.merge, args.report, html=(args.html, args.html_baseline, baseline))
  from .databases import DatabaseOptionError, check_option
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


# The exit statuses of ua-verify, ua-repro and ua-fuzz (docs/VERIFICATION.md, "Exit statuses").
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _verdict(code: int, report: dict, args) -> tuple[str, int, list[str]]:
  """(verdict, exit status, notes) of a run: the plugin's count of problems
  (failures, harness errors, crashes, timeouts); INCOMPLETE when a time box
  ended before every property, and every feature and dtype the implementation
  declares, had a case (unless --partial); INTERRUPTED on Ctrl-C."""
  import pytest

  from .plugin import report_problems
  if code == pytest.ExitCode.USAGE_ERROR:
    return "USAGE ERROR", EXIT_USAGE, []
  if code == pytest.ExitCode.INTERRUPTED:
    return "INTERRUPTED", EXIT_INTERRUPTED, [
        "interrupted (Ctrl-C): the verdict covers nothing; the case that was running keeps "
        f"its file under {args.failures}"]
  if report_problems(report) or not report.get("cases") or code != 0:
    return "FAIL", EXIT_FAIL, []
  notes = []
  missing = _properties_not_run(args.impl, report)
  if missing:
    notes.append(f"not run{' (the time box ended first)' if args.minutes else ''}: "
                 f"{', '.join(missing)}")
  untested = _declared_groups_untested(args.impl, report)
  if untested:
    notes.append(f"no case of: {', '.join(untested)}")
  if args.minutes is not None and (missing or untested) and not args.partial:
    notes.append("the time box ended before the implementation's declared features were "
                 "all tested: a longer --minutes, or --partial for a verdict on what ran")
    return "INCOMPLETE", EXIT_INCOMPLETE, notes
  if notes:
    notes[-1] += ": the verdict covers the rest only"
  return "PASS", EXIT_PASS, notes


def _declared_groups_untested(impl_name: str, report: dict) -> list[str]:
  """The features and dtypes ``impl_name`` declares that no case of the report had."""
  from .capabilities import load_impl
  from .case import FEATURES
  try:
    impl = load_impl(impl_name)
  except Exception:  # noqa: BLE001 -- the run already loaded it; nothing to add
    return []
  groups = report.get("feature_groups", {})
  wanted = [f for f in FEATURES if f not in impl.unsupported]
  wanted += [f"dtype:{d}" for d in impl.dtypes]
  return [g for g in wanted if not groups.get(g, {}).get("cases")]


def _check_html(parser, args) -> dict | None:
  """--html and --html-baseline, checked before anything runs: matplotlib
  present, the page's directory there, the baseline a readable report. Returns
  the baseline report (None without one)."""
  if args.html_baseline and not args.html:
    parser.error("--html-baseline needs --html FILE")
  if not args.html:
    return None
  from .html_report import MissingMatplotlib, require_matplotlib
  try:
    require_matplotlib()
  except MissingMatplotlib as exc:
    parser.error(str(exc))
  html_dir = os.path.dirname(os.path.abspath(args.html))
  if not os.path.isdir(html_dir):
    parser.error(f"--html {args.html}: no directory {html_dir}")
  if not args.html_baseline:
    return None
  try:
    with open(args.html_baseline) as f:
      baseline = json.load(f)
  except (OSError, ValueError) as exc:
    parser.error(f"--html-baseline {args.html_baseline}: not a readable JSON report "
                 f"({type(exc).__name__}: {exc})")
  if not isinstance(baseline, dict) or "properties" not in baseline:
    parser.error(f"--html-baseline {args.html_baseline}: not a ua-verify report")
  return baseline


def _write_html(path: str, report: dict, baseline_path: str | None, baseline: dict | None):
  from .html_report import write_html
  write_html(path, report, baseline, baseline_path)
  print(f"HTML report written to {path}")


def _merge(parser, paths: list[str], out: str, html=(None, None, None)) -> int:
  """ua-verify --merge: the reports of several hosts as one (plugin.merge_reports)."""
  from .plugin import merge_reports, write_report
  reports = []
  for path in paths:
    try:
      with open(path) as f:
        reports.append((path, json.load(f)))
    except (OSError, ValueError) as exc:
      parser.error(f"--merge {path}: not a readable JSON report ({type(exc).__name__}: {exc})")
  try:
    merged = merge_reports(reports)
  except (ValueError, TypeError, KeyError, AttributeError) as exc:
    parser.error(f"--merge: {exc}")
  print(f"unified-attention verification, merged from {len(merged['merged_from'])} reports:")
  for source in merged["merged_from"]:
    print(f"  {source['report']}: host {source.get('host') or '?'}, commit "
          f"{source.get('commit') or '?'}, {source.get('impl')}, profile "
          f"{source.get('profile')}, {source['cases']} cases, "
          f"{source.get('problems', 0)} failures or errors")
  write_report(sys.stdout.write, merged)
  with open(out, "w") as f:
    json.dump(merged, f, indent=1, default=str)
  failed = [s["report"] for s in merged["merged_from"] if s.get("problems")]
  verdict = "FAIL" if failed or not merged["cases"] else "PASS"
  print(f"\n{verdict}: {merged['cases']} cases from {len(merged['merged_from'])} reports "
        f"(hosts {', '.join(merged['hosts']) or '?'}; commits "
        f"{', '.join(merged['commits']) or '?'})"
        + (f"; failures in {', '.join(failed)}" if failed else "")
        + f"; merged report written to {out}")
  if html[0]:
    _write_html(html[0], merged, html[1], html[2])
  return 0 if verdict == "PASS" else 1


def _properties_not_run(impl_name: str, report: dict) -> list[str]:
  """The properties that ``impl_name`` supports and no case of the report ran."""
  from .capabilities import load_impl
  from .registry import PROPERTIES
  try:
    impl = load_impl(impl_name)
  except Exception:  # noqa: BLE001 -- pytest has reported it
    return []
  ran = {name for name, row in report.get("properties", {}).items() if row.get("cases")}
  return [p.name for p in PROPERTIES if p.unsupported_by(impl) is None and p.name not in ran]


def repro_main(argv=None) -> int:
  """ua-repro CASE.json [--impl module:function] [--minimize]: replays one saved
  case here; with --minimize, reduces it while it fails the same way and writes
  CASE.min.json beside it (properties/minimize.py)."""
  parser = argparse.ArgumentParser(prog="ua-repro", description=repro_main.__doc__)
  parser.add_argument("case_file")
  parser.add_argument("--impl", default=None,
                      help="implementation (default: the one recorded in the file)")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  parser.add_argument("--minimize", action="store_true",
                      help="reduce the case while the same property fails on the same "
                           "outputs; write <name>.min.json beside it")
  parser.add_argument("--max-attempts", type=int, default=200,
                      help="with --minimize: candidate cases to run at most")
  parser.add_argument("--max-seconds", type=float, default=600.0,
                      help="with --minimize: no new candidate after this many seconds")
  args = parser.parse_args(argv)
  if args.max_attempts < 1 or not args.max_seconds > 0:
    parser.error("--max-attempts and --max-seconds must be positive")
  from .case import load_case_file, versions
  try:
    payload = load_case_file(args.case_file)
  except (OSError, ValueError, KeyError, TypeError) as exc:
    parser.error(f"{args.case_file}: not a readable case file ({type(exc).__name__}: {exc})")
  names = ",".join([args.imports] + list(payload.get("imports", ())))
  try:
    imports = tuple(dict.fromkeys(import_modules(names)))
  except Exception as exc:  # noqa: BLE001 -- a usage error, not a reproduction
    parser.error(f"--import {names}: {type(exc).__name__}: {exc}")
  invalid = payload["case"].invalid()
  if invalid:
    parser.error(f"{args.case_file}: not a case the suite draws: {invalid}")
  from .capabilities import load_impl
  from .checks import PropertyFailure
  from .registry import get
  from .tolerance import error_table

  impl_name = args.impl or payload.get("impl") or DEFAULT_IMPL
  try:
    impl = load_impl(impl_name)
  except Exception as exc:  # noqa: BLE001 -- nothing ran: not a reproduction
    parser.error(f"--impl {impl_name}: cannot load the implementation "
                 f"({type(exc).__name__}: {exc})")
  try:
    prop = get(payload.get("property", "matches_oracle"))
  except ValueError as exc:
    parser.error(f"{args.case_file}: {exc}")
  declared = prop.unsupported_by(impl)
  if declared is not None:
    parser.error(f"{args.case_file}: {prop.name} does not run on {impl_name}: {declared}")
  case = payload["case"]
  recorded, now = payload.get("versions", {}), versions()
  where = now.get("device", now["backend"])
  print(f"case: {case}\nproperty: {prop.name}\nimpl: {impl_name}\n"
        f"recorded: status {payload.get('status', 'failed')} on {recorded.get('device', recorded.get('backend'))}"
        f" {recorded}\nnow: {now}")
  if payload.get("status") in ("crashed", "timeout", "running"):
    print(f"note: this case {payload['status']} its worker when recorded; it may do so here")
  if args.minimize:
    from .minimize import minimize_file
    return minimize_file(args.case_file, payload, impl, prop, imports=imports,
                         max_attempts=args.max_attempts, max_seconds=args.max_seconds)
  try:
    errors = prop.check(impl, case)
  except PropertyFailure as exc:
    print(f"FAIL: reproduces on {where}\n{exc}")
    return 1
  except Exception as exc:  # noqa: BLE001 -- the implementation (or the harness) raised
    print(f"FAIL: reproduces on {where}: raised {type(exc).__name__}: {exc}")
    return 1
  print(error_table(errors) if errors else "(no comparison)")
  print(f"PASS: does not reproduce on {where}" +
        (f" (recorded on {recorded.get('device', recorded.get('backend'))})"
         if recorded.get("backend") != now["backend"] else ""))
  return 0


def _derivative_hint(case, failed_outputs) -> str:
  """What a capped case failing in dq/dk alone points to."""
  grads = {"dq", "dk"}
  if case.cap_method != "none" and set(failed_outputs) and set(failed_outputs) <= grads:
    return (f"\nhint: dq/dk fail while out/dv pass on a {case.cap_method!r}-capped case: "
            f"the cap's hand-written derivative is the likely cause")
  return ""


def fuzz_main(argv=None) -> int:
  """ua-fuzz --cap NAME --minutes M: a randomized campaign on one cap method.

  First checks the method itself (derivative against autodiff, declared
  bounds and homogeneity, the implementation's own forms); then draws
  attention cases with that cap until the time is up or a failure is found,
  which is reported once, with its replay command.
  """
  parser = argparse.ArgumentParser(prog="ua-fuzz", description=fuzz_main.__doc__)
  parser.add_argument("--cap", required=True)
  parser.add_argument("--minutes", type=float, default=5.0)
  parser.add_argument("--impl", default=DEFAULT_IMPL)
  parser.add_argument("--out", default="ua-failures", help="where failing cases go")
  parser.add_argument("--profile", default="dev", choices=PROFILE_NAMES,
                      help="whose shape buckets to draw from")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  args = parser.parse_args(argv)
  if not args.minutes > 0:
    parser.error(f"--minutes must be positive, got {args.minutes:g}")
  try:
    imports = import_modules(args.imports)
  except Exception as exc:  # noqa: BLE001 -- a usage error
    parser.error(f"--import {args.imports}: {type(exc).__name__}: {exc}")
  from hypothesis import HealthCheck, Phase, given, settings
  from hypothesis import strategies as st
  from hypothesis.database import DirectoryBasedExampleDatabase

  from ua_reference.caps import get_cap_method
  from .cap_checks import precheck
  from .capabilities import load_impl
  from .profiles import PROFILES
  from .registry import PROPERTIES
  from .strategies import cases
  from .verifier import CaseFailure, Verifier

  try:
    method = get_cap_method(args.cap)
  except ValueError as exc:
    parser.error(f"--cap: {exc}")
  try:
    impl = load_impl(args.impl)
  except Exception as exc:  # noqa: BLE001 -- a usage error
    parser.error(f"--impl {args.impl}: cannot load the implementation "
                 f"({type(exc).__name__}: {exc})")
  if args.cap != "none" and "cap" in impl.unsupported:
    parser.error(f"{args.impl} declares cap methods unsupported")
  if not impl.supports_cap(method.name):
    parser.error(f"{args.impl} declares cap method {method.name!r} unsupported "
                 f"(ua_cap_methods)")
  forms = impl.cap_forms(method.name) if impl.cap_forms else None
  print(f"checking cap method {method.name!r} (derivative, bounds, homogeneity, "
        f"{'the implementation form' if forms else 'no implementation form'})...", flush=True)
  problem = precheck(method.name, forms)
  if problem:
    print(f"FAIL: {problem}")
    return 1
  print("cap method consistent with its declarations", flush=True)

  # Properties that a case capped with this method can exercise: those the
  # implementation can run, needing no feature but the cap and not replacing
  # the cap with another method.
  usable = [p for p in PROPERTIES if p.unsupported_by(impl) is None
            and not set(p.require) - {"cap"} and "cap" not in p.forbid
            and p.uses_cap_method is None]
  buckets = PROFILES[args.profile].buckets
  verifier = Verifier(impl, args.out, imports)
  deadline = time.time() + 60 * args.minutes
  ran = 0

  @st.composite
  def drawn(draw):
    prop = draw(st.sampled_from([p for p in usable if p.oracle] * 4 + usable))
    case = draw(cases(buckets, impl, prop.require, prop.forbid, prop.any_of,
                      cap=args.cap).filter(prop.applies))
    return prop, case

  # Rounds of fresh random examples until the time is up; a failure saved by
  # an earlier campaign replays first (and is reported, once, like a new one).
  @settings(max_examples=25, deadline=None, derandomize=False,
            database=DirectoryBasedExampleDatabase(f".hypothesis/ua-fuzz-{args.cap}"),
            phases=[Phase.reuse, Phase.generate, Phase.target],
            suppress_health_check=list(HealthCheck))
  @given(drawn())
  def campaign(item):
    nonlocal ran
    if time.time() < deadline:
      ran += 1
      verifier.check(*item)

  try:
    while time.time() < deadline:
      campaign()
  except CaseFailure as exc:
    print(f"\nFAIL after {ran} case(s):\n{exc}{_derivative_hint(exc.case, exc.failed_outputs)}")
    print(f"\nua-fuzz --cap {args.cap}: stopped at the first failure")
    return 1
  print(f"\nua-fuzz --cap {args.cap}: {ran} cases in {args.minutes:g} min, no failure")
  return 0


if __name__ == "__main__":
  sys.exit(verify_main())
