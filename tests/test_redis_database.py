"""Campaigns on several hosts sharing one Redis example database
(ua-verify --shared-database redis://HOST:PORT/DB, properties/campaign/databases.py),
against a real redis-server on a loopback port; and ua-verify --merge.

Two campaigns, each with its own local directory database and failures
directory (as on two hosts) and the same Redis URL, run an implementation
whose defect shows only with a negative sm_scale: the first finds it
and saves it into Redis; the second, with nothing in its own directory,
replays it as its very first case (Hypothesis's reuse phase), where the first
campaign's first case was Hypothesis's simplest one, which passes.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from properties import cli
from properties.campaign.databases import DatabaseOptionError, redis_client

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"

# The reference, 1% off when an input is large (a kernel whose exp overflows,
# say): the profile's "large" and "saturating" value distributions, two draws
# in five; never Hypothesis's simplest case ("normal" values, whose largest
# |q| is about 4). The defect depends on the input values only, so the failure
# shrinks to the simplest shapes, compiled for the first case.
PLANTED = '''
import jax.numpy as jnp

import ua_reference


def attention(q, k, v, **kwargs):
  out = ua_reference.attention(q, k, v, **kwargs)
  return jnp.where(jnp.max(jnp.abs(q)) > 6.0, out * 1.01, out)


attention.ua_unsupported = {"causal", "window", "segment_ids", "cap", "temperature",
                            "z_loss", "gqa", "lse"}
attention.ua_dtypes = ("float32",)
attention.ua_head_dims = (16,)
'''

# A plugin for the campaigns' pytest: the suite's own case records of each
# test (pytest's report user_properties, in the order the cases ran), one JSON
# line per test.
CASE_ORDER = '''
import json, os


def pytest_runtest_logreport(report):
  cases = [v for k, v in report.user_properties if k == "ua_case"]
  if report.when == "call" and cases:
    with open(os.environ["UA_CASE_ORDER"], "a") as f:
      f.write(json.dumps({"test": report.nodeid, "cases": [
          {"case": c["case"], "status": c["status"]} for c in cases]}) + "\\n")
'''

PROPERTY_TEST = "matches_oracle-float32"
KEY_PREFIX = f"ua-examples:planted_defect:attention:{PROPERTY_TEST}:"


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _redis_missing() -> str | None:
  if not os.path.exists(REDIS_SERVER):
    return f"no {REDIS_SERVER}: apt-get install redis-server"
  try:
    import redis  # noqa: F401
  except ImportError:
    return "no redis package: pip install '.[test]' (or '.[redis]')"
  return None


@pytest.fixture
def redis_url(tmp_path):
  """A redis-server of its own on a free loopback port, nothing persisted;
  stopped at teardown. Without redis-server (or the redis package): a skip,
  but under CI None, and the test fails saying what to install."""
  missing = _redis_missing()
  if missing:
    if not os.environ.get("CI"):
      pytest.skip(missing)
    yield None
    return
  import redis
  port = _free_port()
  log = open(tmp_path / "redis-server.log", "w")
  proc = subprocess.Popen([REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1",
                           "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                          stdout=log, stderr=subprocess.STDOUT)
  url = f"redis://127.0.0.1:{port}/0"
  client = redis.Redis.from_url(url, socket_connect_timeout=1)
  try:
    deadline = time.time() + 20
    while True:
      try:
        if client.ping():
          break
      except redis.ConnectionError:
        pass
      if proc.poll() is not None or time.time() > deadline:
        raise RuntimeError(f"redis-server did not answer PING: "
                           f"{(tmp_path / 'redis-server.log').read_text()[-2000:]}")
      time.sleep(0.05)
    yield url
  finally:
    client.close()
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
    log.close()


def _campaign(tmp_path, host: str, url: str):
  """One ua-verify campaign (the dev profile: Hypothesis's reuse phase) of
  matches_oracle in float32, with its own directory database and failures."""
  work = tmp_path / host
  work.mkdir()
  order = work / "cases.jsonl"
  # The time goes into XLA's compiles (three per shape): less optimized ones,
  # kept in a compilation cache that both campaigns share.
  env = dict(os.environ, UA_CASE_ORDER=str(order),
             XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
             PYTHONPATH=os.pathsep.join(
      [str(tmp_path), str(Path(__file__).parent.parent)]
      + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
  cmd = [sys.executable, "-m", "properties.cli", "--impl", "planted_defect:attention",
         "--profile", "dev", "-n", "0", "--database", str(work / "examples"),
         "--shared-database", url, "--failures", str(work / "failures"),
         "--report", str(work / "report.json"), "--compile-cache", str(tmp_path / "jax-cache"),
         "--",
         "-p", "case_order_plugin", "-k",
             "matches_oracle and float32 and not x64 and not cap and not mask and not long and not feature"]
  start = time.time()
  proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=300)
  [line] = order.read_text().splitlines()
  record = json.loads(line)
  assert record["test"].endswith(f"[{PROPERTY_TEST}]"), record
  print(f"{host}: {len(record['cases'])} cases in {time.time() - start:.1f} s")
  return proc, record["cases"], work


def test_a_second_campaign_replays_the_failure_the_first_saved_in_redis(tmp_path, redis_url):
  if redis_url is None:  # CI: must run
    pytest.fail(_redis_missing())
  import redis
  (tmp_path / "planted_defect.py").write_text(PLANTED)
  (tmp_path / "case_order_plugin.py").write_text(CASE_ORDER)
  client = redis.Redis.from_url(redis_url)
  keys = lambda: sorted(client.keys("*"))
  assert keys() == []

  first, first_cases, a = _campaign(tmp_path, "host-a", redis_url)
  assert first.returncode == 1, first.stdout[-3000:] + first.stderr[-3000:]
  saved = keys()
  assert saved and all(k.startswith(KEY_PREFIX.encode()) for k in saved), saved
  # The failure Hypothesis reported (its last case) and the case file it left.
  failing = first_cases[-1]
  assert failing["status"] == "failed", first_cases
  assert first_cases[0]["status"] == "passed"  # the simplest case: batch 1
  assert (a / "failures" / f"matches_oracle-{failing['case']}.json").exists()

  second, second_cases, b = _campaign(tmp_path, "host-b", redis_url)
  assert second.returncode == 1, second.stdout[-3000:] + second.stderr[-3000:]
  # Its own directory database was empty: the case came from Redis, first.
  assert second_cases[0] == failing, (second_cases, first_cases)
  assert first_cases[0]["case"] != failing["case"]
  assert (b / "failures" / f"matches_oracle-{failing['case']}.json").exists()
  report = json.loads((b / "report.json").read_text())
  assert report["properties"]["matches_oracle"]["failures"] >= 1
  assert report["host"] == socket.gethostname() and "commit" in report

  # The two hosts' reports, merged: both failed, so the merge does.
  merged = tmp_path / "merged.json"
  assert cli.verify_main(["--merge", str(a / "report.json"), str(b / "report.json"),
                          "--report", str(merged)]) == 1
  merged = json.loads(merged.read_text())
  assert merged["cases"] == report["cases"] + json.loads((a / "report.json").read_text())["cases"]
  assert len(merged["merged_from"]) == 2 and merged["hosts"] == [socket.gethostname()]


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:notaport/0", "malformed Redis URL"),
    ("redis://127.0.0.1:6379/zero", "must be a number"),
    ("redis://:6379/0", "no host"),
    ("http://127.0.0.1:6379/0", "not a directory nor a Redis URL"),
])
def test_a_malformed_url_is_a_usage_error_naming_the_option(url, message, capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.verify_main(["--profile", "dev", "--shared-database", url])
  err = capsys.readouterr().err
  assert exit_.value.code == 2 and f"--shared-database {url}: " in err and message in err


def test_plain_pytest_gets_one_usage_error_naming_its_option(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "--pyargs", "properties.suite", "-q", "-p",
       "no:cacheprovider", "--ua-shared-database=redis://127.0.0.1:notaport/0"],
      cwd=tmp_path, capture_output=True, text=True, timeout=120,
      env=dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent)))
  assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert "--ua-shared-database redis://127.0.0.1:notaport/0: malformed Redis URL" in proc.stderr


def test_without_the_redis_package_the_option_says_so(monkeypatch):
  monkeypatch.setitem(sys.modules, "redis", None)  # what an absent package imports as
  with pytest.raises(DatabaseOptionError, match=r"--database redis://h:6379/0: .*needs the "
                                                r"redis package"):
    redis_client("--database", "redis://h:6379/0")


def test_an_unreachable_server_is_a_usage_error(capsys):
  pytest.importorskip("redis")
  url = f"redis://127.0.0.1:{_free_port()}/0"  # nothing listens there
  with pytest.raises(SystemExit):
    cli.verify_main(["--profile", "dev", "--database", url])
  assert f"--database {url}: the Redis server does not answer" in capsys.readouterr().err


# --------------------------------------------------------------------------- #
# ua-verify --merge

def _row(cases, failures=0, harness=0, ratio=0.1, seconds=10.0):
  return {"cases": cases, "failures": failures, "harness_errors": harness,
          "worst_ratio": ratio, "seconds": seconds}


def _report(host, commit, props, groups, failures=(), exit_status=0, seconds=480.0):
  cases = sum(r["cases"] for r in props.values())
  return {"cases": cases, "oracle_cases": props.get("matches_oracle", {"cases": 0})["cases"],
          "seconds": seconds, "cases_per_minute": round(cases / seconds * 60, 1),
          "oracle_cases_per_minute": 0.0, "feature_groups": groups, "properties": props,
          "failures": list(failures), "crashed": [], "impl": "ua_kernels:attention",
          "profile": "gpu", "exit_status": exit_status, "host": host, "commit": commit}


def test_merge_sums_the_hosts_reports(tmp_path, capsys):
  a = _report("host-a", "abc123", {"matches_oracle": _row(500, ratio=0.5),
                                   "deterministic": _row(3, seconds=1.0)},
              {"causal": _row(200, ratio=0.5), "plain": _row(303, ratio=0.2)}, seconds=480.0)
  failure = {"property": "matches_oracle", "status": "failed",
             "replay": "ua-repro ua-failures/matches_oracle-0123.json --impl ua_kernels:attention",
             "failed_outputs": ["dk"]}
  b = _report("host-b", "abc123", {"matches_oracle": _row(400, failures=1, ratio=2.7)},
              {"causal": _row(150, failures=1, ratio=2.7), "window": _row(250, ratio=0.3)},
              failures=[failure], exit_status=1, seconds=470.0)
  paths = []
  for name, report in (("host-a.json", a), ("host-b.json", b)):
    paths.append(str(tmp_path / name))
    Path(paths[-1]).write_text(json.dumps(report))
  out = tmp_path / "merged.json"
  assert cli.verify_main(["--merge", *paths, "--report", str(out)]) == 1
  printed = capsys.readouterr().out
  merged = json.loads(out.read_text())
  assert merged["properties"]["matches_oracle"] == _row(900, failures=1, ratio=2.7, seconds=20.0)
  assert merged["properties"]["deterministic"] == _row(3, seconds=1.0)
  assert merged["feature_groups"]["causal"] == _row(350, failures=1, ratio=2.7, seconds=20.0)
  assert merged["feature_groups"]["window"]["cases"] == 250
  assert merged["cases"] == 903 and merged["seconds"] == 480.0
  assert merged["hosts"] == ["host-a", "host-b"] and merged["commits"] == ["abc123"]
  assert [s["report"] for s in merged["merged_from"]] == paths
  assert merged["failures"] == [dict(failure, host="host-b")]
  assert "FAILED matches_oracle (dk) on host-b" in printed
  assert "replay:   ua-repro ua-failures/matches_oracle-0123" in printed
  assert "FAIL: 903 cases from 2 reports" in printed and f"failures in {paths[1]}" in printed
  for line in ("matches_oracle", "causal"):
    assert any(l.startswith(line) and "2.700" in l for l in printed.splitlines()), printed

  # Passing reports merge to a pass; a merged report merges again, source by source.
  assert cli.verify_main(["--merge", paths[0], "--report", str(tmp_path / "a.json")]) == 0
  again = tmp_path / "again.json"
  assert cli.verify_main(["--merge", str(out), paths[0], "--report", str(again)]) == 1
  assert len(json.loads(again.read_text())["merged_from"]) == 3


def test_merge_refuses_what_is_not_a_report(tmp_path, capsys):
  bad = tmp_path / "bad.json"
  bad.write_text(json.dumps({"hello": 1}))
  with pytest.raises(SystemExit) as exit_:
    cli.verify_main(["--merge", str(bad), "--report", str(tmp_path / "m.json")])
  assert exit_.value.code == 2 and "not a ua-verify report" in capsys.readouterr().err
