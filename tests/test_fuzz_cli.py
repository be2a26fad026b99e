"""ua-fuzz as a user meets it: a module registering a cap method, one command.

A derivative that forgets a 1/c is named as the cap's fault before any
attention case runs; a consistent method goes on to attention cases and
reports a failure once, with a hint when only dq/dk fail on a capped case."""

import sys

import pytest

from properties import cli
from properties.case import Case
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
  assert "derivative is the likely cause" in cli._derivative_hint(case, ["dq", "dk"])
  assert cli._derivative_hint(case, ["dq", "dv"]) == ""


def test_a_campaign_reports_its_failure_once_and_stops(tmp_path, monkeypatch, capsys):
  monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
  monkeypatch.chdir(tmp_path)
  code = cli.fuzz_main(["--cap", "tanh", "--minutes", "2", "--profile", "ci",
                        "--impl", "outside_kernels:off_when_capped_attention"])
  out = capsys.readouterr().out
  assert code == 1 and "stopped at the first failure" in out
  assert out.count("replay: ua-repro ") == 1, out[-3000:]
