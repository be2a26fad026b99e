"""ua-verify's verdict on a run and the exit statuses of the CLIs
(docs/VERIFICATION.md, "Exit statuses")."""

from __future__ import annotations


# The exit statuses of ua-verify, ua-repro and ua-fuzz (docs/VERIFICATION.md, "Exit statuses").
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_INCOMPLETE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _verdict(code: int, report: dict, args) -> tuple[str, int, list[str]]:
  """(verdict, exit status, notes) of a run: the plugin's count of problems
  (failures, harness errors, crashes, timeouts); INCOMPLETE when a time box
  ended before every property, and every feature and dtype the implementation
  declares, had a case (unless --partial); INTERRUPTED on Ctrl-C."""
  import pytest

  from ..campaign.merge import report_problems
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
  from ..model.capabilities import load_impl
  from ..model.case import FEATURES
  try:
    impl = load_impl(impl_name)
  except Exception:  # noqa: BLE001 -- the run already loaded it; nothing to add
    return []
  groups = report.get("feature_groups", {})
  wanted = [f for f in FEATURES if f not in impl.unsupported]
  wanted += [f"dtype:{d}" for d in impl.dtypes]
  return [g for g in wanted if not groups.get(g, {}).get("cases")]


def _properties_not_run(impl_name: str, report: dict) -> list[str]:
  """The properties that ``impl_name`` supports and no case of the report ran."""
  from ..model.capabilities import load_impl
  from ..checks.registry import PROPERTIES
  try:
    impl = load_impl(impl_name)
  except Exception:  # noqa: BLE001 -- pytest has reported it
    return []
  ran = {name for name, row in report.get("properties", {}).items() if row.get("cases")}
  return [p.name for p in PROPERTIES if p.unsupported_by(impl) is None and p.name not in ran]
