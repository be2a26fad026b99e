"""ua-verify --html: a report (the JSON ua-verify writes, or a merged one) as
one self-contained HTML page.

The page holds, with inline CSS and its plots as base64 PNG (matplotlib, the
``html`` extra) and nothing fetched from elsewhere:

- where the report came from: implementation, profile, totals, and for a
  merged report each host's report with its commit;
- per output (out, lse, dq, dk, dv) and dtype, the distribution of
  error/tolerance over the oracle properties' cases, beside a baseline
  report's (``--html-baseline``) where one is given;
- the worst cases, each with the command that replays it (a passed case's
  file is gone: the page carries it as a download, rebuilt from the
  configuration the report keeps);
- compile and run seconds per feature group.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math

OUTPUTS = ("out", "lse", "dq", "dk", "dv", "dsinks")
DTYPES = ("float32", "bfloat16", "float16")
SMALLEST = 1e-6  # error/tolerance below this (zero included) sits in the first bin
EXTRA = "pip install 'unified-attention[html]' (or: pip install matplotlib)"

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td.name, th.name { text-align: left; }
code { background: #f6f6f6; padding: 1px 4px; font-size: 0.85em; word-break: break-all; }
.grid { display: grid; grid-template-columns: repeat(3, minmax(0, 1fr)); gap: 0.8em; }
.grid figure { margin: 0; } .grid img { width: 100%; height: auto; }
.fail { color: #b00020; font-weight: bold; } .pass { color: #1b7f3a; font-weight: bold; }
.note { color: #666; font-size: 0.9em; }
"""


class MissingMatplotlib(RuntimeError):
  """--html was asked for where matplotlib is not installed."""


def require_matplotlib():
  """matplotlib.pyplot on the non-interactive Agg backend, or MissingMatplotlib
  naming the extra that installs it."""
  try:
    import matplotlib
  except ImportError:
    raise MissingMatplotlib(f"--html draws its plots with matplotlib, which is not "
                            f"installed: {EXTRA}") from None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


# --------------------------------------------------------------------------- #
# The numbers.

def ratios_by_output(report: dict | None) -> dict[tuple[str, str], list]:
  """error/tolerance per (output, dtype) over the report's oracle cases (None:
  not finite). A report without per-case records gives none."""
  out: dict[tuple[str, str], list] = {}
  for r in (report or {}).get("records", ()):
    if not r.get("oracle", True) or "ratios" not in r:
      continue
    for name, ratio in r["ratios"].items():
      out.setdefault((name, r.get("dtype", "?")), []).append(ratio)
  return out


def summary(ratios: list) -> dict:
  """Cases, non-finite ones, median, 99th percentile and largest error/tolerance."""
  finite = sorted(r for r in ratios if r is not None)
  pick = lambda q: finite[min(len(finite) - 1, int(q * len(finite)))] if finite else None
  return {"cases": len(ratios), "non_finite": len(ratios) - len(finite),
          "over_1": sum(r is None or r > 1 for r in ratios),
          "median": pick(0.5), "p99": pick(0.99), "max": finite[-1] if finite else None}


def _ordered_keys(*tables) -> list[tuple[str, str]]:
  keys = set().union(*(t.keys() for t in tables))
  rank = lambda seq, x: seq.index(x) if x in seq else len(seq)
  return sorted(keys, key=lambda k: (rank(OUTPUTS, k[0]), k[0], rank(DTYPES, k[1]), k[1]))


# --------------------------------------------------------------------------- #
# The plots.

def _png(fig) -> str:
  """A figure as a data: URL (and closed)."""
  buf = io.BytesIO()
  fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
  fig.clf()
  import matplotlib.pyplot as plt
  plt.close(fig)
  return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _log_values(ratios: list) -> list[float]:
  return [math.log10(max(r, SMALLEST)) for r in ratios if r is not None]


def histogram(plt, title: str, now: list, base: list | None) -> str:
  """The distribution of log10 error/tolerance, as fractions of cases (a
  baseline of another size compares), the tolerance at 0."""
  fig, ax = plt.subplots(figsize=(4.2, 2.6))
  values = _log_values(now) + _log_values(base or [])
  low = min([math.log10(SMALLEST)] + values)
  high = max([0.5] + values)
  bins = [low + (high - low) * i / 30 for i in range(31)]
  for data, label, style in ((base, "baseline", dict(histtype="step", color="#555", lw=1.5)),
                             (now, "this run", dict(alpha=0.6, color="#3366cc"))):
    logs = _log_values(data or [])
    if logs:
      ax.hist(logs, bins=bins, weights=[1 / len(logs)] * len(logs),
              label=f"{label} ({len(logs)})", **style)
  ax.axvline(0.0, color="#b00020", lw=1, ls="--")
  ax.set_title(title, fontsize=10)
  ax.set_xlabel(f"log10 error/tolerance (tolerance at 0; <= {math.log10(SMALLEST):.0f}: tiny or 0)",
                fontsize=7)
  ax.set_ylabel("fraction of cases", fontsize=8)
  ax.tick_params(labelsize=7)
  ax.legend(fontsize=7)
  return _png(fig)


def time_bars(plt, groups: dict) -> str | None:
  """Compile and run seconds per feature group, stacked horizontal bars."""
  rows = [(name, row) for name, row in groups.items() if "compile_seconds" in row]
  if not rows:
    return None
  fig, ax = plt.subplots(figsize=(7, 0.28 * len(rows) + 1))
  names = [name for name, _ in rows]
  compile_s = [row["compile_seconds"] for _, row in rows]
  run_s = [row["run_seconds"] for _, row in rows]
  ax.barh(names, compile_s, color="#e69f00", label="compile")
  ax.barh(names, run_s, left=compile_s, color="#3366cc", label="run")
  ax.invert_yaxis()
  ax.set_xlabel("seconds (its cases' times summed)", fontsize=8)
  ax.tick_params(labelsize=7)
  ax.legend(fontsize=8)
  return _png(fig)


# --------------------------------------------------------------------------- #
# The page's sections.

def _e(x) -> str:
  return html.escape(str(x))


def _fmt(x, digits=3) -> str:
  if x is None:
    return "&ndash;"
  if isinstance(x, float):
    return "inf" if math.isinf(x) else f"{x:.{digits}g}" if abs(x) < 1e-3 and x else f"{x:.{digits}f}"
  return _e(x)


def _table(head: list[str], rows: list[list], name_cols: int = 1, text=()) -> str:
  """A table whose first ``name_cols`` columns and ``text`` columns are
  left-aligned (numbers right)."""
  left = lambda i: ' class="name"' if i < name_cols or i in text else ""
  th = "".join(f"<th{left(i)}>{_e(h)}</th>" for i, h in enumerate(head))
  body = "".join("<tr>" + "".join(f"<td{left(i)}>{c}</td>" for i, c in enumerate(row))
                 + "</tr>" for row in rows)
  return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def header(report: dict, baseline_name: str | None) -> str:
  problems = sum(row.get("failures", 0) + row.get("harness_errors", 0)
                 for row in report.get("properties", {}).values()) + len(report.get("crashed", ()))
  verdict = (f'<span class="fail">{problems} failures or errors</span>' if problems
             else '<span class="pass">no failures</span>')
  impl = report.get("impl")
  impl = ", ".join(impl) if isinstance(impl, list) else impl
  lines = [f"<p>Implementation <code>{_e(impl)}</code>, profile {_e(report.get('profile'))}: "
           f"{report.get('cases', 0)} cases ({report.get('oracle_cases', 0)} against the oracle) "
           f"in {report.get('seconds', 0)} s; {verdict}.</p>"]
  if "compile_seconds" in report:
    hits = report.get("cache_hits")
    lines.append(f"<p>Case time: {report['compile_seconds']:.1f} s compiling "
                 f"({report.get('compiled', 0)} compilations"
                 + ("" if hits is None else f", {hits} from the persistent cache")
                 + f"), {report['run_seconds']:.1f} s running.</p>")
  if baseline_name:
    lines.append(f"<p>Baseline: <code>{_e(baseline_name)}</code>.</p>")
  return "\n".join(lines)


def sources(report: dict) -> str:
  """The hosts and commits a report came from."""
  merged = report.get("merged_from")
  if not merged:
    return (f"<h2>Source</h2><p>Host {_e(report.get('host') or '?')}, commit "
            f"<code>{_e(report.get('commit') or '?')}</code>.</p>")
  rows = [[f"<code>{_e(s.get('report'))}</code>", _e(s.get("host") or "?"),
           f"<code>{_e(s.get('commit') or '?')}</code>", _e(s.get("impl")), _e(s.get("profile")),
           _e(s.get("cases")), _fmt(s.get("seconds"), 1), _e(s.get("problems", 0))]
          for s in merged]
  return (f"<h2>Sources: {len(merged)} reports, hosts {_e(', '.join(report.get('hosts', [])))}; "
          f"commits {_e(', '.join(report.get('commits', [])))}</h2>"
          + _table(["report", "host", "commit", "impl", "profile", "cases", "seconds",
                    "failures or errors"], rows, name_cols=4))


def distributions(plt, report: dict, baseline: dict | None) -> str:
  now, base = ratios_by_output(report), ratios_by_output(baseline)
  if not now:
    return ("<h2>error/tolerance per output and dtype</h2><p class=\"note\">This report "
            "holds no per-case records (written before they were kept).</p>")
  keys = _ordered_keys(now, base) if baseline else _ordered_keys(now)
  figures, rows = [], []
  for output, dtype in keys:
    mine, theirs = now.get((output, dtype), []), base.get((output, dtype)) if baseline else None
    title = f"{output}, {dtype}"
    figures.append(f'<figure><img alt="error/tolerance of {_e(title)}" '
                   f'src="{histogram(plt, title, mine, theirs)}"></figure>')
    s = summary(mine)
    row = [_e(output), _e(dtype), s["cases"], s["over_1"], _fmt(s["median"]), _fmt(s["p99"]),
           _fmt(s["max"])]
    if baseline is not None:
      b = summary(theirs or [])
      row += [b["cases"], _fmt(b["median"]), _fmt(b["p99"]), _fmt(b["max"])]
    rows.append(row)
  head = ["output", "dtype", "cases", "over tolerance", "median", "p99", "max"]
  if baseline is not None:
    head += ["baseline cases", "baseline median", "baseline p99", "baseline max"]
  return ("<h2>error/tolerance per output and dtype (oracle properties)</h2>"
          + _table(head, rows, name_cols=2) + f'<div class="grid">{"".join(figures)}</div>')


def _case_file(case: dict, impl: str) -> tuple[str, str] | None:
  """(file name, data: URL) of a passed case's file, rebuilt from the
  configuration the report keeps (ua-repro reads it like the verifier's)."""
  if not case.get("config"):
    return None
  name = f"{case['property']}-{case['case']}.json"
  payload = {"property": case["property"], "impl": impl, "case": case["config"],
             "status": case.get("status", "passed"), "errors": [], "message": "",
             "imports": case.get("imports", []),
             "versions": {"backend": "not recorded (case file rebuilt from a report)"},
             "replay": replay_command(name, impl, case.get("imports", ()))}
  data = base64.b64encode(json.dumps(payload, indent=1, sort_keys=True).encode()).decode()
  return name, "data:application/json;base64," + data


def replay_command(path: str, impl: str, imports=()) -> str:
  """verifier.replay_command's form (not imported: that module imports jax)."""
  cmd = f"ua-repro {path} --impl {impl}"
  return cmd + (f" --import {','.join(imports)}" if imports else "")


def worst(report: dict) -> str:
  cases = report.get("worst_cases") or []
  if not cases:
    return "<h2>Worst cases</h2><p class=\"note\">The report keeps no worst cases.</p>"
  default_impl = report.get("impl") if isinstance(report.get("impl"), str) else None
  rows = []
  for c in cases:
    impl = c.get("impl") or default_impl
    if c.get("replay"):
      replay = f"<code>{_e(c['replay'])}</code>"
    elif impl and (made := _case_file(c, impl)):
      name, url = made
      replay = (f'<code>{_e(replay_command(name, impl, c.get("imports", ())))}</code> '
                f'<a download="{_e(name)}" href="{url}">case file</a>')
    else:
      replay = '<span class="note">no configuration kept</span>'
    ratios = ", ".join(f"{_e(k)} {_fmt(v)}" for k, v in (c.get("ratios") or {}).items())
    config = c.get("config") or {}
    shape = (f"B={config.get('batch')} T={config.get('seq_len')} "
             f"H={config.get('num_q_heads')}/{config.get('num_kv_heads')} "
             f"D={config.get('head_dim')}" if config else "")
    rows.append([_e(c["property"]), _e(c.get("dtype", "")), _e(c.get("status", "")),
                 _fmt(float("inf") if c.get("ratio") is None else c["ratio"]),
                 ratios, _e(shape), _e(c.get("host", "")), replay])
  return ("<h2>Worst cases (largest error/tolerance)</h2>"
          + _table(["property", "dtype", "status", "err/tol", "per output", "shape", "host",
                    "replay"], rows, name_cols=3, text=(4, 5, 6, 7)))


def times(plt, report: dict) -> str:
  groups = report.get("feature_groups", {})
  if not any("compile_seconds" in row for row in groups.values()):
    return ("<h2>Time per feature group</h2><p class=\"note\">This report does not split "
            "compile and run time (written before the split).</p>")
  hits = any("cache_hits" in row for row in groups.values())
  rows = []
  for name, row in groups.items():
    cells = [_e(name), row.get("cases", 0), _fmt(row.get("seconds"), 1),
             _fmt(row.get("compile_seconds"), 1), _fmt(row.get("run_seconds"), 1),
             row.get("compiled", 0)]
    rows.append(cells + ([row.get("cache_hits", 0)] if hits else []))
  head = ["feature group", "cases", "seconds", "compile s", "run s", "compiled"]
  head += ["cache hits"] if hits else []
  bars = time_bars(plt, groups)
  img = f'<img alt="compile and run seconds per feature group" src="{bars}">' if bars else ""
  return ("<h2>Compile and run time per feature group</h2><p class=\"note\">A case counts in "
          "every group it belongs to; with several workers a row can exceed the wall time."
          "</p>" + _table(head, rows) + img)


def render(report: dict, baseline: dict | None = None, baseline_name: str | None = None) -> str:
  """The page, as a string."""
  plt = require_matplotlib()
  body = [f"<h1>unified-attention verification</h1>", header(report, baseline_name),
          sources(report), distributions(plt, report, baseline), worst(report),
          times(plt, report)]
  return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
          "<title>unified-attention verification report</title>"
          f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def write_html(path: str, report: dict, baseline: dict | None = None,
               baseline_name: str | None = None) -> None:
  page = render(report, baseline, baseline_name)
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)
