"""ua-fuzz as a user meets it: a module registering a cap method, one command.

A derivative that forgets a 1/c is named as the cap's fault before any
attention case runs; a consistent method goes on to attention cases and
reports a failure once, with a hint when only dq/dk fail on a capped case."""

import sys

import pytest

from properties import cli
from properties.cli.fuzz import _derivative_hint
from properties.model.case import Case
from ua_reference.caps import CAP_METHODS

MY_CAPS = '''
import jax.numpy as jnp
from ua_reference import register_cap_method

# c * sign(x) * log(1 + |x|/c); its derivative is 1 / (1 + |x|/c).
register_cap_method("logcap_test", ("c",),
                    lambda x, c: c * jnp.sign(x) * jnp.log1p(jnp.abs(x) / c),
                    lambda x, c: 1.0 / (1.0 + jnp.abs(x)),   # forgets the 1/c
                    homogeneous=True)
'''


@pytest.fixture
def my_caps(tmp_path, monkeypatch):
  (tmp_path / "my_caps_test.py").write_text(MY_CAPS)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.chdir(tmp_path)
  yield "my_caps_test"
  CAP_METHODS.pop("logcap_test", None)
  sys.modules.pop("my_caps_test", None)


def test_a_wrong_derivative_is_named_before_any_attention_case(my_caps, capsys):
  code = cli.fuzz_main(["--cap", "logcap_test", "--minutes", "1", "--import", my_caps,
                        "--impl", "ua_reference:attention"])
  out = capsys.readouterr().out
  assert code == 1
  assert "cap method 'logcap_test'" in out and "derivative differs from autodiff" in out
  assert "at x = " in out and "FAIL after" not in out  # no attention case ran


def test_the_derivative_hint():
  case = Case(batch=1, seq_len=3, num_q_heads=1, num_kv_heads=1, head_dim=16,
              dtype="float32", cap_method="tanh", cap_params=(1.0,))
  assert "derivative is the likely cause" in _derivative_hint(case, ["dq", "dk"])
  assert _derivative_hint(case, ["dq", "dv"]) == ""


def test_a_campaign_reports_its_failure_once_and_stops(tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
  monkeypatch.chdir(tmp_path)
  code = cli.fuzz_main(["--cap", "tanh", "--minutes", "2", "--profile", "ci",
                        "--impl", "outside_kernels:off_when_capped_attention"])
  out = capsys.readouterr().out
  assert code == 1 and "stopped at the first failure" in out
  assert out.count("replay: ua-repro ") == 1, out[-3000:]


def _usage_error(main, argv, capsys):
  """main(argv) exits with argparse's usage status 2; returns its message."""
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--cap", "tanh", "--minutes", "0"], "--minutes must be positive"),
    (["--cap", "nosuch"], "unknown cap_method 'nosuch'"),
    (["--cap", "tanh", "--impl", "no_such_module_test:attention"], "cannot load"),
    (["--cap", "tanh", "--import", "no_such_module_test"], "--import no_such_module_test"),
    (["--cap", "hard", "--impl", "outside_kernels:tanh_only_attention"],
     "declares cap method 'hard' unsupported"),
])
def test_fuzz_misuse_is_a_usage_error(argv, message, capsys, monkeypatch):
  monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
  assert message in _usage_error(cli.fuzz_main, argv, capsys)


def test_repro_without_its_implementation_or_case_is_a_usage_error(tmp_path, capsys):
  """Nothing ran, so it is not a reproduction: usage errors, not "FAIL: reproduces"."""
  assert "not a readable case file" in _usage_error(
      cli.repro_main, [str(tmp_path / "missing.json")], capsys)
  (tmp_path / "empty.json").write_text("{}")
  assert "not a readable case file" in _usage_error(
      cli.repro_main, [str(tmp_path / "empty.json")], capsys)
  case = Case(batch=1, seq_len=3, num_q_heads=1, num_kv_heads=1, head_dim=16, dtype="float32")
  from properties.model.case import write_case_file
  path = tmp_path / "case.json"
  write_case_file(path, case, "matches_oracle", "no_such_module_test:attention", status="failed")
  err = _usage_error(cli.repro_main, [str(path)], capsys)
  assert "cannot load the implementation" in err and "reproduces" not in err


@pytest.mark.parametrize("argv, message", [
    (["--report", "/nonexistent-dir-test/r.json"], "--report /nonexistent-dir-test/r.json"),
    (["--minutes", "-1"], "--minutes must be positive"),
])
def test_verify_misuse_is_a_usage_error(argv, message, capsys):
  assert message in _usage_error(cli.verify_main, argv, capsys)


def test_verify_failures_path_that_is_a_file_is_a_usage_error(tmp_path, capsys):
  (tmp_path / "f").write_text("")
  assert "is not a directory" in _usage_error(
      cli.verify_main, ["--failures", str(tmp_path / "f")], capsys)


def test_ua_verify_checks_imported_caps_before_any_case(my_caps, capsys):
  code = cli.verify_main(["--import", my_caps, "--impl", "ua_reference:attention", "-n", "0"])
  out = capsys.readouterr().out
  assert code == 1
  assert out.startswith("FAIL: cap method 'logcap_test'") and "derivative differs" in out
  assert "unified-attention verification" not in out  # no case ran
