"""The exact mask property (properties/checks/mask_check.py) on the reference and on
implementations with one planted mask defect each: a correct one passes at long
T, every leaked or dropped (query, key) pair fails it, and the failure names
the first such pair."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

import ua_reference
from properties.checks import mask_check
from properties.model.capabilities import declare
from properties.model.case import Case
from properties.checks.mask_check import MaskMismatch, mask_is_exact

REFERENCE = declare("ua_reference:attention", ua_reference.attention)


@pytest.fixture(params=["numpy", "jit"])
def array_path(request, monkeypatch):
  """Both ways the check counts: numpy (a CPU backend) and jax.numpy under
  jit (an accelerator, where the counting stays on the device)."""
  monkeypatch.setattr(mask_check, "_xp", lambda: np if request.param == "numpy" else jnp)
  return request.param


def _planted(name, **override):
  """The reference with some static arguments replaced (a planted mask defect)."""
  @functools.wraps(ua_reference.attention)
  def attention(q, k, v, **kwargs):
    return ua_reference.attention(q, k, v, **{**kwargs, **override})
  return declare(name, attention)


@pytest.mark.parametrize("case", [
    Case(1, 300, 2, 1, 32, "bfloat16", causal=True, seed=1),
    Case(1, 257, 4, 2, 16, "float16", window_len=40, segments="packed", temperature="signed",
         cap_method="tanh", cap_params=(1.0,), z_loss_weight=0.1, seed=2),
    Case(2, 100, 2, 2, 64, "float32", causal=True, window_len=7, segments="random", seed=3),
], ids=["causal-T300", "window-packed-gqa-T257", "causal-window-random-ids"])
def test_the_reference_sees_exactly_the_visible_keys(case, array_path):
  errors = mask_is_exact(REFERENCE, case)
  assert {e.name for e in errors} == {f"{n} (visible set)" for n in ("out", "dv", "dq", "dk")}
  assert all(e.ok and e.max_abs_err == 0 for e in errors)


def test_a_window_one_key_too_long_fails_on_every_output(array_path):
  case = Case(1, 70, 2, 2, 16, "float32", window_len=9, seed=4)
  leaky = _planted("window+1", window_len=10)
  with pytest.raises(MaskMismatch) as failure:
    mask_is_exact(leaky, case)
  message = str(failure.value)
  for name in ("out", "dv", "dq", "dk"):
    # queries 9..69 see one key too many, in each of the 2 heads
    assert f"{name}: 122 hidden keys seen, 0 visible ones dropped" in message
  # query 9 is the first that can tell a window of 9 from one of 10: it sees key 0
  assert "query 9, key 0" in message


def test_a_dropped_causal_diagonal_fails_as_dropped_keys(array_path):
  """A non-causal call computed as causal drops every future key: 40 * 39 / 2."""
  case = Case(1, 40, 1, 1, 16, "bfloat16", seed=5)
  dropping = _planted("causal", causal=True)
  with pytest.raises(MaskMismatch) as failure:
    mask_is_exact(dropping, case)
  assert "0 hidden keys seen, 780 visible ones dropped" in str(failure.value)


def test_rows_repeating_the_last_chunk_count_once(array_path, monkeypatch):
  """T = 70 at D = 16 is 5 chunks; a call of 4 rows leaves 3 spare rows in the
  second call, which repeat chunk 4 and must not count its leaks again."""
  case = Case(1, 70, 1, 1, 16, "float32", causal=True, seed=6)
  leaky = _planted("no causal", causal=False)
  monkeypatch.setattr(mask_check, "ELEMENT_BUDGET", 4 * 70 * 16)
  with pytest.raises(MaskMismatch) as failure:
    mask_is_exact(leaky, case)
  assert "out: 2415 hidden keys seen, 0 visible ones dropped" in str(failure.value)
