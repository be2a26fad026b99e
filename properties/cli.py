"""Command-line entry points: ua-verify, ua-repro, ua-fuzz."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _import_modules(names):
  """--import: modules that register cap methods; also passed to pytest."""
  import importlib
  names = [n for n in (names or "").split(",") if n]
  for name in names:
    importlib.import_module(name)
  if names:
    os.environ["UA_IMPORT"] = ",".join(filter(None, [os.environ.get("UA_IMPORT"), *names]))


def repro_main(argv=None) -> int:
  """ua-repro CASE.json [--impl module:function]: replays one saved case."""
  parser = argparse.ArgumentParser(prog="ua-repro", description=repro_main.__doc__)
  parser.add_argument("case_file")
  parser.add_argument("--impl", default=None,
                      help="implementation (default: the one recorded in the file)")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  args = parser.parse_args(argv)
  _import_modules(args.imports)
  from .case import load_case_file, versions
  from .checks import PROPERTIES, PropertyFailure
  from .impls import DEFAULT_IMPL, load_impl
  from .tolerance import error_table

  payload = load_case_file(args.case_file)
  impl_name = args.impl or payload.get("impl") or DEFAULT_IMPL
  prop = payload.get("property", "matches_oracle")
  case = payload["case"]
  print(f"case: {case}\nproperty: {prop}\nimpl: {impl_name}\nrecorded with: "
        f"{payload.get('versions')}\nnow: {versions()}")
  try:
    errors = PROPERTIES[prop](load_impl(impl_name), case)
  except PropertyFailure as exc:
    print(f"FAIL\n{exc}")
    return 1
  except Exception as exc:  # noqa: BLE001 -- the implementation itself raised
    print(f"FAIL: the implementation raised {type(exc).__name__}: {exc}")
    return 1
  print(error_table(errors) if errors else "(no numeric outputs)")
  print("PASS")
  return 0


def _pytest_args(impl, profile, extra):
  return [str(REPO / "tests" / "test_properties.py"), "-q", "-p", "no:cacheprovider",
          f"--impl={impl}", f"--hypothesis-profile={profile}", *extra]


def _report(report_dir: str) -> dict:
  rows = collections.defaultdict(lambda: {"cases": 0, "failures": 0, "worst_ratio": 0.0})
  props = collections.defaultdict(lambda: {"cases": 0, "failures": 0, "worst_ratio": 0.0})
  for path in glob.glob(os.path.join(report_dir, "results-*.jsonl")):
    with open(path) as f:
      for line in f:
        r = json.loads(line)
        targets = [rows[g] for g in r["groups"]] + [props[r["property"]]]
        for row in targets:
          row["cases"] += 1
          row["failures"] += 0 if r["passed"] else 1
          row["worst_ratio"] = max(row["worst_ratio"], r["ratio"])
  return {"feature_groups": dict(sorted(rows.items())), "properties": dict(sorted(props.items()))}


def _print_table(title, table):
  print(f"\n{title:40} {'cases':>6} {'failures':>8} {'worst err/tol':>14}")
  for name, row in table.items():
    ratio = "inf" if row["worst_ratio"] >= 1e300 else f"{row['worst_ratio']:.3f}"
    print(f"{name:40} {row['cases']:6d} {row['failures']:8d} {ratio:>14}")


def verify_main(argv=None) -> int:
  """ua-verify: runs every property and prints a report by feature group."""
  parser = argparse.ArgumentParser(prog="ua-verify", description=verify_main.__doc__)
  parser.add_argument("--impl", default="ua_kernels:attention")
  parser.add_argument("--profile", default="ci", choices=["ci", "dev", "fuzz", "gpu"])
  parser.add_argument("--report", default="ua-report.json", help="JSON report path")
  parser.add_argument("-n", "--workers", default="auto",
                      help="pytest-xdist workers ('0' for none)")
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  args = parser.parse_args(argv)
  _import_modules(args.imports)
  import pytest

  from .case import versions
  start = time.time()
  with tempfile.TemporaryDirectory() as report_dir:
    os.environ["UA_REPORT_DIR"] = report_dir
    extra = [] if args.workers == "0" else ["-n", args.workers]
    code = pytest.main(_pytest_args(args.impl, args.profile, extra))
    report = _report(report_dir)
  report.update(impl=args.impl, profile=args.profile, exit_code=int(code),
                seconds=round(time.time() - start, 1), versions=versions())
  _print_table("feature group", report["feature_groups"])
  _print_table("property", report["properties"])
  with open(args.report, "w") as f:
    json.dump(report, f, indent=1)
  failures = sum(r["failures"] for r in report["properties"].values())
  verdict = "PASS" if code == 0 and failures == 0 else "FAIL"
  print(f"\n{verdict}: {args.impl}, profile {args.profile}, {report['seconds']} s; "
        f"report written to {args.report}")
  return 0 if verdict == "PASS" else 1


def fuzz_main(argv=None) -> int:
  """ua-fuzz --cap NAME --minutes M: a randomized campaign on one cap method."""
  parser = argparse.ArgumentParser(prog="ua-fuzz", description=fuzz_main.__doc__)
  parser.add_argument("--cap", required=True)
  parser.add_argument("--minutes", type=float, default=5.0)
  parser.add_argument("--impl", default="ua_kernels:attention")
  parser.add_argument("--out", default="ua-failures", help="where failing cases go")
  parser.add_argument("--buckets", default="dev", choices=["ci", "dev", "gpu"])
  parser.add_argument("--import", dest="imports", default="",
                      help="comma-separated modules that register cap methods")
  args = parser.parse_args(argv)
  _import_modules(args.imports)
  from hypothesis import HealthCheck, Phase, given, settings
  from hypothesis import strategies as st
  from hypothesis.database import DirectoryBasedExampleDatabase

  from ua_kernels.cap_functions import get_cap_method
  from . import checks
  from .impls import load_impl, unsupported
  from .strategies import BUCKETS, cases

  get_cap_method(args.cap)
  impl = load_impl(args.impl)
  if args.cap != "none" and "cap" in unsupported(impl):
    parser.error(f"{args.impl} declares cap methods unsupported")
  os.environ["UA_FAILURE_DIR"] = args.out
  checks.FAILURE_DIR = args.out
  deadline = time.time() + 60 * args.minutes
  strategy = cases(BUCKETS[args.buckets], unsupported(impl), cap=args.cap)
  failures, rounds = [], 0

  @settings(max_examples=20, deadline=None, derandomize=False,
            database=DirectoryBasedExampleDatabase(f".hypothesis/ua-fuzz-{args.cap}"),
            phases=[Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
            suppress_health_check=list(HealthCheck))
  @given(case=strategy, prop=st.sampled_from(["matches_oracle"] * 4 + [
      "gqa_equals_repeated_heads", "hidden_keys_do_not_leak", "deterministic"]))
  def campaign(case, prop):
    if prop == "gqa_equals_repeated_heads" and case.num_q_heads == case.num_kv_heads:
      prop = "matches_oracle"
    if prop == "hidden_keys_do_not_leak" and not (case.causal or case.window_len
                                                  or case.segments != "none"):
      prop = "matches_oracle"
    checks.run_property(prop, impl, args.impl, case)

  while time.time() < deadline:
    rounds += 1
    try:
      campaign()
    except AssertionError as exc:
      failures.append(str(exc).splitlines()[-1])
      print(f"round {rounds}: FAILURE\n{exc}\n", flush=True)
    else:
      print(f"round {rounds}: 20 examples passed", flush=True)
  print(f"\nua-fuzz --cap {args.cap}: {rounds} rounds, {len(failures)} failing case(s)")
  for line in failures:
    print("  " + line)
  return 1 if failures else 0
