"""ua-verify --merge and --html: the reports of several hosts as one, and a
report as one HTML page (docs/VERIFICATION.md)."""

from __future__ import annotations

import json
import os
import sys


def _check_html(parser, args) -> dict | None:
  """--html and --html-baseline, checked before anything runs: matplotlib
  present, the page's directory there, the baseline a readable report. Returns
  the baseline report (None without one)."""
  if args.html_baseline and not args.html:
    parser.error("--html-baseline needs --html FILE")
  if not args.html:
    return None
  from ..campaign.html_report import MissingMatplotlib, require_matplotlib
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
  from ..campaign.html_report import write_html
  write_html(path, report, baseline, baseline_path)
  print(f"HTML report written to {path}")


def _merge(parser, paths: list[str], out: str, html=(None, None, None)) -> int:
  """ua-verify --merge: the reports of several hosts as one (campaign.merge.merge_reports)."""
  from ..campaign.merge import merge_reports
  from ..campaign.report import write_report
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
