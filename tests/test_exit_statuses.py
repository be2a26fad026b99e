"""The CLIs' exit statuses, one table (docs/VERIFICATION.md, "Exit statuses"):
0 pass, 1 failures, 2 usage errors (an invalid case file, an implementation
that does not load, an unwritable directory), 3 a time box that ended before
every declared feature was tested, 130 Ctrl-C, whose running case keeps its
file."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from properties.cli.verdict import (EXIT_FAIL, EXIT_INCOMPLETE, EXIT_INTERRUPTED, EXIT_PASS,
                                    EXIT_USAGE)

TESTS = Path(__file__).parent
CASE = {"case": {"batch": 1, "seq_len": 16, "num_q_heads": 2, "num_kv_heads": 1,
                 "head_dim": 16, "dtype": "float32", "cap_method": "none", "cap_params": [],
                 "seed": 3},
        "property": "matches_oracle", "impl": "ua_reference:attention"}


def _cli(tmp_path, *args, timeout=600):
  env = dict(os.environ, PYTHONPATH=str(TESTS))
  return subprocess.run([sys.executable, "-c", "import sys; from properties import cli; "
                         "sys.exit(getattr(cli, sys.argv[1])(sys.argv[2:]))", *args],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("field, value, said", [
    ("seq_len", -5, "seq_len must be a positive int"),
    ("dtype", "float64", "dtype must be one of"),
    ("cap_method", "no_such_cap", "cap_method 'no_such_cap' is not registered"),
    ("num_q_heads", 3, "num_q_heads (3) must be a multiple of num_kv_heads (2)"),
])
def test_an_invalid_case_file_is_a_usage_error_naming_the_field(field, value, said, tmp_path):
  payload = json.loads(json.dumps(CASE))
  payload["case"][field] = value
  if field == "num_q_heads":
    payload["case"]["num_kv_heads"] = 2
  (tmp_path / "case.json").write_text(json.dumps(payload))
  proc = _cli(tmp_path, "repro_main", "case.json")
  assert proc.returncode == EXIT_USAGE and said in proc.stderr, proc.stderr[-2000:]


def test_a_valid_case_file_reproduces_nothing_on_a_correct_implementation(tmp_path):
  (tmp_path / "case.json").write_text(json.dumps(CASE))
  proc = _cli(tmp_path, "repro_main", "case.json")
  assert proc.returncode == EXIT_PASS, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("main", ["verify_main", "repro_main", "fuzz_main"])
def test_an_implementation_that_does_not_import_is_a_usage_error_everywhere(main, tmp_path):
  (tmp_path / "case.json").write_text(json.dumps(CASE))
  args = {"verify_main": ["-n", "0"], "repro_main": ["case.json"],
          "fuzz_main": ["--minutes", "1"]}[main]
  proc = _cli(tmp_path, main, *args, "--impl", "no_such_module_here:attention")
  assert proc.returncode == EXIT_USAGE, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_a_box_that_ends_before_the_declared_features_is_incomplete(tmp_path):
  args = ("verify_main", "--impl", "ua_reference:attention", "-n", "0", "--minutes", "0.02")
  proc = _cli(tmp_path, *args)
  assert proc.returncode == EXIT_INCOMPLETE, proc.stdout[-3000:]
  assert "INCOMPLETE: ua_reference:attention" in proc.stdout and "no case of: " in proc.stdout
  partial = _cli(tmp_path, *args, "--partial")
  assert partial.returncode == EXIT_PASS, partial.stdout[-3000:]
  assert "the verdict covers the rest only" in partial.stdout


def test_a_crash_counts_in_the_verdict(tmp_path):
  proc = _cli(tmp_path, "verify_main", "--impl", "outside_kernels:crashing_attention",
              "-n", "1", "--", "-k", "matches_oracle-float32 and not cap and not mask "
              "and not long and not feature")
  assert proc.returncode == EXIT_FAIL and "FAIL: outside_kernels" in proc.stdout


# The child takes SIGINT as a program run from a terminal does. A shell without job control
# starts background commands (`cmd &`, as CI may be started) with SIGINT ignored, every child
# inherits that, and Python then installs no KeyboardInterrupt handler: the hung case ran on to
# its timeout. (Set in the child itself: a preexec_fn forks a multithreaded process.)
_SIGINT_AS_IN_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)"


def test_ctrl_c_keeps_the_running_case_and_says_it_was_interrupted(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(TESTS))
  proc = subprocess.Popen(
      [sys.executable, "-c", f"{_SIGINT_AS_IN_A_TERMINAL}; import sys; "
       "from properties.cli import verify_main; sys.exit(verify_main())",
       "--impl", "outside_kernels:hanging_attention", "-n", "0",
       "--", "-k", "matches_oracle-float32 and not cap and not mask and not long and not feature"],
      cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  deadline = time.time() + 300
  running = []
  while time.time() < deadline and not running:  # a case past T = 16 hangs
    time.sleep(1)
    for path in (tmp_path / "ua-failures").glob("*.json"):
      payload = json.loads(path.read_text())
      if payload["status"] == "running" and payload["case"]["seq_len"] > 16:
        running.append(path)
  assert running, "no hanging case started"
  time.sleep(2)
  proc.send_signal(signal.SIGINT)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == EXIT_INTERRUPTED, out[-3000:]
  assert "INTERRUPTED" in out and "time box" not in out.split("INTERRUPTED")[-1]
  assert json.loads(running[0].read_text())["status"] == "interrupted"


def test_an_unwritable_directory_is_one_usage_error_before_any_case(tmp_path):
  ro = tmp_path / "ro"
  ro.mkdir()
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)],
                           capture_output=True, text=True)
  if mounted.returncode:
    pytest.skip(f"no read-only file system to test with here (mount: {mounted.stderr.strip()})")
  try:
    proc = _cli(ro, "verify_main", "-n", "0", "--minutes", "0.1")
  finally:
    subprocess.run(["umount", str(ro)], check=False)
  assert proc.returncode == EXIT_USAGE, proc.stdout[-2000:]
  assert "is not writable" in proc.stdout + proc.stderr and "cases in" in proc.stdout
