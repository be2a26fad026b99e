"""The report: each case's time split into compiling and running
(properties/run/compile_clock.py) in a real small run's records, their sums per
feature group and property, the persistent cache's hits, and --merge; and
ua-verify --html's page (properties/campaign/html_report.py), loaded in headless
Chromium."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from properties import cli

from properties.run import compile_clock
from properties.model.case import Case
from properties.campaign.merge import merge_reports
from properties.campaign.report import build_report, write_report

from test_suite_plugin import TESTS, run_suite

EPS = 0.005  # each of seconds, compile_seconds, run_seconds is rounded to 1 ms
SMALL_RUN = ("-k", "matches_oracle-float32-mask-causal or deterministic")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
  """ua-verify on the reference, two tests, no workers, with --html: its
  report, page and output."""
  pytest.importorskip("matplotlib")
  tmp = tmp_path_factory.mktemp("report")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [str(TESTS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  env.pop("JAX_COMPILATION_CACHE_DIR", None)  # a cold run without a persistent cache (CI sets one)
  cmd = [sys.executable, "-m", "properties.cli", "--impl", "ua_reference:attention", "-n", "0",
         "--report", str(tmp / "report.json"), "--failures", str(tmp / "failures"),
         "--html", str(tmp / "page.html"), "--", *SMALL_RUN]
  proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return tmp, json.loads((tmp / "report.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def small_report(small_run):
  _, report, printed = small_run
  return report, printed


def test_a_case_compiling_a_new_shape_records_its_compile_time(small_report):
  report, _ = small_report
  records = report["records"]
  assert records and all(r["dtype"] in ("float32", "bfloat16", "float16") for r in records)
  first = records[0]  # the process's first case: everything it runs is compiled anew
  assert first["compile_seconds"] > 0 and first["compiled"] > 0, first
  for r in records:
    assert r["compile_seconds"] >= 0 and r["run_seconds"] >= 0, r
    assert r["compile_seconds"] + r["run_seconds"] <= r["seconds"] + EPS, r
    assert "cache_hits" not in r  # no persistent cache in this run
  oracle = [r for r in records if r["oracle"]]
  assert oracle and all(set(r["ratios"]) >= {"out", "dq", "dk", "dv"} for r in oracle)
  assert all(r["ratio"] == max(r["ratios"].values()) for r in oracle)


def test_every_case_sits_on_the_campaigns_timeline(small_report):
  """A case's start (seconds from the campaign's), worker and harness seconds,
  and the timeline's busy share of the one worker's wall seconds."""
  report, _ = small_report
  records = report["records"]
  assert all(r["worker"] == "main" and 0 <= r["at"] <= report["seconds"] for r in records)
  ats = [r["at"] for r in records]
  assert ats == sorted(ats)  # one worker: in the order they ran
  oracle = [r for r in records if r["oracle"]]
  assert all(0 < r["harness_seconds"] <= r["seconds"] for r in oracle)
  timeline = report["timeline"]
  assert timeline["workers"] == 1
  busy = sum(r["seconds"] for r in records) / report["seconds"]
  # The report's seconds are rounded to 0.1 s, its busy share computed before: a run of 2.7 s
  # moves busy by up to 0.05 / 2.7 of itself (0.938 against 0.926 in one CI run).
  rounding = busy * 0.05 / report["seconds"] + 0.002
  assert timeline["busy_share"] == pytest.approx(busy, abs=rounding)
  assert 0 < busy <= 1 + 0.05 / report["seconds"] + 0.002
  assert timeline["first_case_started"] == pytest.approx(min(ats), abs=0.1)
  assert timeline["last_case_started"] == pytest.approx(max(ats), abs=0.1)


def test_the_report_sums_the_split_per_group_and_property(small_report):
  report, printed = small_report
  records = report["records"]
  for key in ("compile_seconds", "run_seconds", "compiled"):
    assert report[key] == pytest.approx(sum(r[key] for r in records), abs=EPS)
    for name, row in report["properties"].items():
      mine = [r for r in records if r["property"] == name]
      assert row[key] == pytest.approx(sum(r[key] for r in mine), abs=EPS), (name, key)
  causal = report["feature_groups"]["causal"]
  assert causal["compile_seconds"] + causal["run_seconds"] <= causal["seconds"] + EPS * causal["cases"]
  header = next(l for l in printed.splitlines() if l.startswith("property"))
  assert "compile s" in header and "run s" in header and "compiled" in header
  assert "s compiling (" in printed


def _record(case, prop="matches_oracle", groups=("causal", "dtype:float32"), **timing):
  return {"property": prop, "case": case, "oracle": True, "groups": list(groups),
          "dtype": "float32", "status": "passed", "ratio": 0.5, "ratios": {"out": 0.5},
          "seconds": 3.0, "replay": "", "failed_outputs": [], "config": {}, "imports": [],
          **timing}


def test_build_report_and_merge_sum_compile_run_compilations_and_hits():
  a = build_report([_record("a", compile_seconds=2.5, run_seconds=0.5, compiled=7, cache_hits=3),
                    _record("b", compile_seconds=0.0, run_seconds=3.0, compiled=0, cache_hits=0,
                            groups=("window", "dtype:float32"))], [], 60.0)
  row = a["feature_groups"]["dtype:float32"]
  assert (row["compile_seconds"], row["run_seconds"], row["compiled"], row["cache_hits"]) == \
      (2.5, 3.5, 7, 3)
  assert a["feature_groups"]["causal"]["compiled"] == 7
  assert a["feature_groups"]["window"]["compile_seconds"] == 0.0
  assert (a["compile_seconds"], a["run_seconds"], a["compiled"], a["cache_hits"]) == \
      (2.5, 3.5, 7, 3)
  lines = []
  write_report(lines.append, a)
  assert "cache hits" in "".join(lines) and "3 from the persistent cache" in "".join(lines)
  merged = merge_reports([("a.json", dict(a, host="a")), ("b.json", dict(a, host="b"))])
  row = merged["properties"]["matches_oracle"]
  assert (row["compile_seconds"], row["run_seconds"], row["compiled"], row["cache_hits"]) == \
      (5.0, 7.0, 14, 6)
  assert merged["compile_seconds"] == 5.0 and merged["cache_hits"] == 6
  assert len(merged["records"]) == 4 and {r["host"] for r in merged["records"]} == {"a", "b"}


def test_a_warm_persistent_cache_serves_compilations(tmp_path):
  """The second run over the same cache directory: its compilations include
  cache hits, counted from jax's own event. A cold run may hit entries it wrote
  itself (the cache keeps every executable, and distinct jitted callables can
  compile the same one); the warm run hits what the cold one compiled."""
  cache = tmp_path / "cache"
  runs = []
  for name in ("cold", "warm"):
    (tmp_path / name).mkdir()
    proc, report = run_suite(tmp_path / name, "ua_reference:attention",
                             f"--ua-compile-cache={cache}", "-k", "deterministic", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    runs.append(report)
  cold, warm = runs
  assert all("cache_hits" in r for r in cold["records"] + warm["records"])
  assert cold["cache_hits"] < cold["compiled"] / 2, cold["records"]
  assert cold["cache_hits"] < warm["cache_hits"] <= warm["compiled"], warm["records"]
  assert warm["cache_hits"] > warm["compiled"] / 2, warm["records"]
  assert warm["compile_seconds"] < cold["compile_seconds"]


def test_nested_spans_count_once():
  assert compile_clock.union_length([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
  clock = compile_clock.CompileClock()
  now = time.time() - 10  # spans that ended before since() reads them
  mark = compile_clock.Mark(now, clock.compiles, clock.cache_hits)
  clock.on_span(compile_clock.LOWER, now, now + 0.2)
  clock.on_span(compile_clock.TRACE, now + 0.05, now + 0.1)  # a trace inside the lowering
  clock.on_span(compile_clock.BACKEND_COMPILE, now + 0.2, now + 0.3)
  clock.on_span("/jax/something/else", now, now + 5)
  clock.on_event(compile_clock.CACHE_HIT)
  seen = clock.since(mark)
  assert seen["compiled"] == 1 and seen["cache_hits"] == 1
  assert seen["compile_seconds"] == pytest.approx(0.3)  # the nested trace counted once
  assert clock.since(compile_clock.Mark(now + 0.25, 1, 1))["compile_seconds"] == \
      pytest.approx(0.05)  # clipped to the case's window


# --------------------------------------------------------------------------- #
# ua-verify --html

def chromium_dom(page, tmp_path) -> str:
  """The page's DOM after headless Chromium loaded and laid it out."""
  browser = shutil.which("chromium") or shutil.which("chromium-browser")
  if browser is None and os.path.exists("/usr/bin/chromium"):
    browser = "/usr/bin/chromium"
  if browser is None:
    if os.environ.get("CI"):
      pytest.fail("headless Chromium is needed to check the HTML report: apt-get install chromium")
    pytest.skip("no chromium here (apt-get install chromium)")
  profile = tmp_path / "chromium-profile"
  proc = subprocess.run(
      [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
       "--disable-component-update", "--disable-sync", "--no-first-run",
       f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
      capture_output=True, text=True, timeout=180)
  assert proc.returncode == 0 and "<body" in proc.stdout, proc.stderr[-3000:]
  return proc.stdout


def _data_urls(dom: str, kind: str) -> list[str]:
  return re.findall(rf'(?:src|href)="(data:{kind}[^"]*)"', dom)


def test_the_html_page_of_a_run_shows_its_plots_and_replay_commands(small_run, tmp_path):
  tmp, report, printed = small_run
  assert f"HTML report written to {tmp / 'page.html'}" in printed
  dom = chromium_dom(tmp / "page.html", tmp_path)
  pairs = {(o, r["dtype"]) for r in report["records"] if r["oracle"] for o in r["ratios"]}
  images = _data_urls(dom, "image/png;base64,")
  assert len(images) == len(pairs) + 1, (len(images), pairs)  # one per output and dtype, times
  assert all(len(url) > 1000 for url in images)
  for output, dtype in pairs:
    assert f"error/tolerance of {output}, {dtype}" in dom
  assert not re.search(r'(?:src|href)="(?!data:|#)', dom)  # nothing fetched from elsewhere
  assert report["worst_cases"]
  for case in report["worst_cases"]:  # passed: the command and its case file, carried along
    name = f"{case['property']}-{case['case']}.json"
    assert f"ua-repro {name} --impl ua_reference:attention" in dom
  files = _data_urls(dom, "application/json;base64,")
  payload = json.loads(base64.b64decode(files[0].split(",", 1)[1]))
  worst = report["worst_cases"][0]
  assert Case.from_dict(payload["case"]).digest() == worst["case"]
  assert payload["property"] == worst["property"] and payload["impl"] == "ua_reference:attention"
  assert "Compile and run time per feature group" in dom


def test_a_merged_page_names_its_hosts_and_shows_the_baseline(small_run, tmp_path):
  tmp, report, _ = small_run
  other = dict(report, host="host-b", commit="0123456789ab")
  (tmp_path / "b.json").write_text(json.dumps(other))
  page = tmp_path / "merged.html"
  assert cli.verify_main(["--merge", str(tmp / "report.json"), str(tmp_path / "b.json"),
                          "--report", str(tmp_path / "merged.json"), "--html", str(page),
                          "--html-baseline", str(tmp / "report.json")]) == 0
  dom = chromium_dom(page, tmp_path)
  assert "host-b" in dom and "0123456789ab" in dom and report["host"] in dom
  assert "baseline median" in dom and "report.json" in dom
  assert len(_data_urls(dom, "image/png;base64,")) >= 2


def test_html_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
  with pytest.raises(SystemExit) as exit_:
    cli.verify_main(["--merge", "x.json", "--report", str(tmp_path / "m.json"),
                     "--html", str(tmp_path / "page.html")])
  assert exit_.value.code == 2
  assert "unified-attention[html]" in capsys.readouterr().err
