"""Reports of campaigns run side by side on several hosts, as one (ua-verify
--merge; docs/VERIFICATION.md)."""

from __future__ import annotations

import collections

from .report import WORST_CASES, _add_time, _ratio_key, _row


def report_problems(report: dict) -> int:
  """Failures, harness errors and crashes of a report; a run that ended in
  error (pytest's exit status) counts as one when nothing else does."""
  problems = sum(row["failures"] + row["harness_errors"]
                 for row in report.get("properties", {}).values())
  problems = max(problems, len(report.get("failures", ())) + len(report.get("crashed", ())))
  return problems or int(bool(report.get("exit_status")))


def merge_reports(reports: list[tuple[str, dict]]) -> dict:
  """One report from the reports of campaigns run side by side (``(path,
  report)`` pairs; a merged report's own sources count one by one): per
  feature group and property the sums of cases, failures, harness errors,
  seconds, compile and run seconds, compilations and cache hits, and the
  largest worst error/tolerance; the totals' sums, the longest campaign's
  seconds and the sum of the rates; every failure and crash, and every case
  record, marked with its host; the worst cases of all; where each report came
  from (``merged_from``, ``hosts``, ``commits``)."""
  groups, props = collections.defaultdict(_row), collections.defaultdict(_row)
  sources, failures, crashed, records, worst = [], [], [], [], []
  totals = dict.fromkeys(("cases", "oracle_cases", "cases_per_minute",
                          "oracle_cases_per_minute"), 0)
  timing = {}
  seconds, exit_status = 0.0, 0
  for path, report in reports:
    for key in ("feature_groups", "properties", "cases"):
      if key not in report:
        raise ValueError(f"{path}: not a ua-verify report (no {key!r})")
    if "merged_from" in report:
      sources += report["merged_from"]
    else:
      sources.append({"report": path, "host": report.get("host"),
                      "commit": report.get("commit"), "impl": report.get("impl"),
                      "profile": report.get("profile"), "cases": report["cases"],
                      "seconds": report.get("seconds"), "problems": report_problems(report)})
    host = report.get("host") or ("merged" if "merged_from" in report else path)
    for merged, rows in ((groups, report["feature_groups"]), (props, report["properties"])):
      for name, row in rows.items():
        out = merged[name]
        for key in ("cases", "failures", "harness_errors"):
          out[key] += row.get(key, 0)
        _add_time(out, row)
        ratio = row.get("worst_ratio")
        out["worst_ratio"] = max(out["worst_ratio"], float("inf") if ratio is None else ratio)
    failures += [dict(f, host=f.get("host", host)) for f in report.get("failures", ())]
    crashed += [dict(c, host=c.get("host", host)) for c in report.get("crashed", ())]
    records += [dict(r, host=r.get("host", host)) for r in report.get("records", ())]
    worst += [{"impl": report.get("impl"), **w, "host": w.get("host", host)}
              for w in report.get("worst_cases", ())]
    for key in totals:
      totals[key] = round(totals[key] + report.get(key, 0), 1)
    if "compile_seconds" in report:
      _add_time(timing, report)
    seconds = max(seconds, report.get("seconds", 0.0))
    exit_status = exit_status or int(report.get("exit_status", 0) or 0)
  timing.pop("seconds", None)
  distinct = lambda key: sorted({s[key] for s in sources if s.get(key)})
  impls, profiles_ = distinct("impl"), distinct("profile")
  worst.sort(key=lambda w: _ratio_key(w.get("ratio")), reverse=True)
  return {**totals, "seconds": seconds, **timing,
          "feature_groups": dict(sorted(groups.items())), "properties": dict(sorted(props.items())),
          "failures": failures, "crashed": crashed,
          "impl": impls[0] if len(impls) == 1 else impls,
          "profile": profiles_[0] if len(profiles_) == 1 else profiles_,
          "exit_status": exit_status, "hosts": distinct("host"), "commits": distinct("commit"),
          "merged_from": sources, "worst_cases": worst[:WORST_CASES], "records": records}
