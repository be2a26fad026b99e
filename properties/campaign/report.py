"""The campaign's report, built from the case records its tests leave
(docs/VERIFICATION.md): per feature group and property, the worst cases, and
the failures as blocks with their replay commands."""

from __future__ import annotations

import collections


# Per-row sums of a case's time: compile (tracing, lowering, compiling),
# the rest, and compilations (properties/run/compile_clock.py).
TIME_KEYS = ("compile_seconds", "run_seconds", "harness_seconds")


WORST_CASES = 10  # the report's worst cases, with their configurations


def _row() -> dict:
  return {"cases": 0, "failures": 0, "harness_errors": 0, "worst_ratio": 0.0, "seconds": 0.0}


def _add_time(row: dict, source: dict) -> None:
  """Adds a record's (or a row's) seconds and, where it has them (reports
  written before the split have not), its compile and run seconds,
  compilations and persistent-cache hits to ``row``."""
  row["seconds"] = round(row.get("seconds", 0.0) + source.get("seconds", 0.0), 3)
  for key in TIME_KEYS:
    if key in source:
      row[key] = round(row.get(key, 0.0) + source[key], 3)
  for key in ("compiled", "cache_hits"):
    if key in source:
      row[key] = row.get(key, 0) + source[key]


def _ratio_key(ratio) -> float:
  return float("inf") if ratio is None else ratio


def case_record(r: dict, started: float | None = None) -> dict:
  """What the report keeps of every case: enough for the distributions of
  error/tolerance per output and dtype (properties/campaign/html_report.py) and the
  time split, not the configuration; ``at``: seconds from the campaign's
  start to the case's."""
  keys = ("property", "case", "configuration", "seq_len", "oracle", "dtype", "status", "ratio",
          "ratios", "seconds", "compile_seconds", "run_seconds", "harness_seconds", "compiled",
          "cache_hits", "host", "worker")
  out = {k: r[k] for k in keys if k in r}
  if started is not None and "started_at" in r:
    out["at"] = round(r["started_at"] - started, 2)
  return out


def worst_cases(records: list[dict], n: int = WORST_CASES) -> list[dict]:
  """The ``n`` cases of largest error/tolerance, with their configuration and
  replay command (a passed case's file is removed when it passes: its
  configuration is what replays it)."""
  keys = ("property", "case", "dtype", "status", "ratio", "ratios", "replay", "config",
          "imports", "impl", "host")
  worst = sorted(records, key=lambda r: _ratio_key(r.get("ratio")), reverse=True)[:n]
  return [{k: r[k] for k in keys if k in r} for r in worst]


def build_report(records: list[dict], crashed: list[dict], seconds: float,
                 started: float | None = None) -> dict:
  """Per feature group and property: cases, failures, harness errors, worst
  error/tolerance, seconds, and of those seconds the compile and run seconds
  and compilations (persistent-cache hits where the cache was on); every
  case's record (case_record) and the worst cases (worst_cases). A case run
  twice (Hypothesis replays a failing example before it reports it) counts
  once, with its last outcome."""
  records = list({(r["property"], r["case"]): r for r in records}.values())
  groups, props = collections.defaultdict(_row), collections.defaultdict(_row)
  failures, oracle_cases, totals = [], 0, {}
  for r in records:
    oracle_cases += r["oracle"]
    _add_time(totals, r)
    for row in [groups[g] for g in r["groups"]] + [props[r["property"]]]:
      row["cases"] += 1
      row["failures"] += r["status"] == "failed"
      row["harness_errors"] += r["status"] == "harness"
      _add_time(row, r)
      row["worst_ratio"] = max(row["worst_ratio"], _ratio_key(r["ratio"]))
    if r["status"] != "passed":
      failures.append({k: r[k] for k in ("property", "status", "replay", "failed_outputs",
                                          "message", "config") if k in r})
  for c in crashed:
    props[c["property"]]["failures"] += 1
  minutes = max(seconds, 1e-9) / 60
  totals.pop("seconds", None)
  # Distinct compiled configurations (static keys) the oracle cases ran: input
  # seeds of one configuration share its executables.
  configurations = len({(r["property"], r.get("configuration", r["case"]))
                        for r in records if r["oracle"]})
  return {"cases": len(records), "oracle_cases": oracle_cases, "seconds": round(seconds, 1),
          "cases_per_minute": round(len(records) / minutes, 1),
          "oracle_cases_per_minute": round(oracle_cases / minutes, 1),
          "oracle_configurations": configurations,
          "oracle_configurations_per_minute": round(configurations / minutes, 1),
          **totals,
          "feature_groups": dict(sorted(groups.items())), "properties": dict(sorted(props.items())),
          "failures": failures, "crashed": crashed,
          "timeline": timeline(records, seconds, started),
          "worst_cases": worst_cases(records),
          "records": [case_record(r, started) for r in records]}


def skip_reasons(reasons: list[str]) -> dict[str, int]:
  """Tests skipped, counted by reason, the time box's reasons (which name how
  many cases ran) as one: a property that cannot be drawn under the
  declarations says why here, and is neither an error nor a failure."""
  counts = collections.Counter(
      "the time box (--ua-minutes) ended it" if "time box" in r else r for r in reasons)
  return dict(counts.most_common())


def timeline(records: list[dict], seconds: float, started: float | None) -> dict:
  """Where a campaign's wall seconds went besides its cases: how long its
  workers took to start their first case, when the last case started, and the
  share of workers x wall seconds the cases filled (the rest is start-up,
  collection, and workers idle while the last cases of others end)."""
  workers = len({r.get("worker", "main") for r in records}) or 1  # those that ran a case
  busy = sum(r["seconds"] for r in records)
  out = {"workers": workers, "busy_share": round(busy / max(workers * seconds, 1e-9), 3)}
  starts = [r["started_at"] for r in records if "started_at" in r]
  if started is not None and starts:
    out["first_case_started"] = round(min(starts) - started, 1)
    out["last_case_started"] = round(max(starts) - started, 1)
  return out


def _print_table(write, title, table):
  split = any("compile_seconds" in row for row in table.values())
  hits = any("cache_hits" in row for row in table.values())
  write(f"\n{title:38} {'cases':>6} {'failures':>8} {'harness':>8} {'worst err/tol':>14} "
        f"{'seconds':>8}" + (f" {'compile s':>9} {'run s':>8} {'compiled':>8}" if split else "")
        + (f" {'cache hits':>10}" if hits else "") + "\n")
  for name, row in table.items():
    ratio = row["worst_ratio"]
    ratio = "inf" if ratio == float("inf") else f"{ratio:.3f}"
    timing = ""
    if split:
      timing += (f" {row.get('compile_seconds', 0.0):9.1f} {row.get('run_seconds', 0.0):8.1f} "
                 f"{row.get('compiled', 0):8d}")
    if hits:
      timing += f" {row.get('cache_hits', 0):10d}"
    write(f"{name:38} {row['cases']:6d} {row['failures']:8d} {row['harness_errors']:8d} "
          f"{ratio:>14} {row['seconds']:8.1f}{timing}\n")


REPORT_LEGEND = (
    "worst err/tol: the largest error of any output over its tolerance (docs/TOLERANCES.md); "
    "a case passes when every element is within its tolerance, err/tol <= 1.")


def write_report(write, report: dict) -> None:
  """The report's tables, totals and failures (with their replay commands)."""
  write(REPORT_LEGEND + "\n")
  _print_table(write, "feature group", report["feature_groups"])
  _print_table(write, "property", report["properties"])
  write(f"\n{report['cases']} cases ({report['oracle_cases']} against the oracle) in "
        f"{report['seconds']} s: {report['cases_per_minute']} cases/min, "
        f"{report['oracle_cases_per_minute']} oracle cases/min"
        + (f" ({report['oracle_configurations']} compiled configurations, "
           f"{report['oracle_configurations_per_minute']}/min)"
           if "oracle_configurations" in report else "") + "\n")
  if "compile_seconds" in report:
    hits = report.get("cache_hits")
    write(f"case time: {report['compile_seconds']:.1f} s compiling ({report['compiled']} "
          f"compilations{'' if hits is None else f', {hits} from the persistent cache'}), "
          f"{report['run_seconds']:.1f} s running\n")
  for reason, count in report.get("skipped", {}).items():
    write(f"skipped: {count} test{'s' if count > 1 else ''}: {reason}\n")
  from ..judge.gates import summary_lines
  for line in summary_lines(report):
    write(line + "\n")
  for line in failure_blocks(report):
    write(line + "\n")


def _size(failure: dict) -> int:
  c = failure.get("config") or {}
  return (c.get("batch", 1) * c.get("seq_len", 1) * c.get("num_q_heads", 1)
          * c.get("head_dim", 1)) if c else 1 << 62


def describe(config: dict) -> str:
  """A case in one line: its shape and the options it turns on."""
  c = config
  parts = [f"B={c['batch']} T={c['seq_len']} H={c['num_q_heads']}/{c['num_kv_heads']} "
           f"D={c['head_dim']} {c['dtype']}"]
  parts += [name for name in ("causal",) if c.get("causal")]
  if c.get("window_len"):
    parts.append(f"window={c['window_len']}")
  if c.get("segments", "none") != "none":
    parts.append(f"segments={c['segments']}")
  if c.get("cap_method", "none") != "none":
    parts.append(f"cap={c['cap_method']}{tuple(c.get('cap_params', ()))}")
  for key in ("temperature", "distribution"):
    if c.get(key) not in (None, "none", "normal"):
      parts.append(f"{key}={c[key]}")
  if c.get("sm_scale") is not None:
    parts.append(f"sm_scale={c['sm_scale']:.4g}")
  if c.get("z_loss_weight"):
    parts.append(f"z_loss={c['z_loss_weight']}")
  if c.get("return_lse"):
    parts.append("lse")
  return " ".join(parts)


def failure_blocks(report: dict) -> list[str]:
  """One block per distinct failure (property and the outputs that failed),
  the smallest case first: what failed, on which case, the replay and the
  minimize commands; then one line for each further case of the same kind."""
  failures = report["failures"] + report["crashed"]
  if not failures:
    return []
  kinds = collections.defaultdict(list)
  for f in sorted(failures, key=_size):
    key = (f["property"], f["status"], tuple(f.get("failed_outputs") or ()))
    if f["replay"] not in {g["replay"] for g in kinds[key]}:
      kinds[key].append(f)
  lines = [f"\n{len(failures)} failing cases, {len(kinds)} distinct; the smallest of each "
           f"first (replay it with ua-repro; --minimize reduces it further):"]
  for (prop, status, outputs), group in sorted(kinds.items(), key=lambda kv: _size(kv[1][0])):
    first = group[0]
    kind = {"harness": "harness error", "failed": "FAILED"}.get(status, status.upper())
    where = f" on {first['host']}" if first.get("host") else ""
    what = f" ({', '.join(outputs)})" if outputs else ""
    lines.append(f"\n{kind} {prop}{what}{where}")
    if first.get("config"):
      lines.append(f"  case:     {describe(first['config'])}")
    if first.get("message"):
      lines.append("  why:      " + first["message"].strip().splitlines()[0][:200])
    lines.append(f"  replay:   {first['replay']}")
    lines.append(f"  minimize: {first['replay']} --minimize")
    if len(group) > 1:
      lines.append(f"  and {len(group) - 1} more such case{'s' if len(group) > 2 else ''}:")
      lines += [f"    {g['replay']}" for g in group[1:6]]
      if len(group) > 6:
        lines.append(f"    ... ({len(group) - 6} more in the JSON report)")
  return lines
