"""ua_deterministic: an implementation whose reruns are bitwise identical is held
to that (``deterministic``); one that declares them not (its reductions ordered
by the hardware) is held to run-to-run differences within its tolerance
(``reruns_within_tolerance``), so that neither an honest reordering nor a race
is mistaken for the other."""

import pytest

from properties.checks.checks import PropertyFailure
from properties.checks.registry import BY_NAME
from properties.model.capabilities import CapabilityError, declare, load_impl
from properties.model.case import Case

CASE = Case(batch=1, seq_len=33, num_q_heads=2, num_kv_heads=1, head_dim=16, dtype="float32",
            causal=True, seed=4)


def test_the_declaration_picks_the_property():
  plain = load_impl("ua_reference:attention")
  reordered = load_impl("outside_kernels:reordered_sums_attention")
  assert plain.deterministic and not reordered.deterministic
  assert BY_NAME["deterministic"].unsupported_by(plain) is None
  assert "reruns_within_tolerance" in BY_NAME["deterministic"].unsupported_by(reordered)
  assert BY_NAME["reruns_within_tolerance"].unsupported_by(reordered) is None
  assert "deterministic" in BY_NAME["reruns_within_tolerance"].unsupported_by(plain)


def test_a_reordering_passes_and_its_size_is_reported():
  reordered = load_impl("outside_kernels:reordered_sums_attention")
  errors = BY_NAME["reruns_within_tolerance"].run(reordered, CASE)
  out = next(e for e in errors if e.name == "out")
  assert 0 < out.max_abs_err and out.ok  # the reruns differ, within the tolerance
  with pytest.raises(PropertyFailure, match="two identical calls differ"):
    BY_NAME["deterministic"].run(reordered, CASE)  # what it would fail, undeclared


def test_a_race_fails():
  with pytest.raises(PropertyFailure, match="out"):
    BY_NAME["reruns_within_tolerance"].run(load_impl("outside_kernels:racy_attention"), CASE)


def test_the_declaration_is_a_bool():
  def fn(q, k, v, **kwargs):
    return q
  fn.ua_deterministic = "no"
  with pytest.raises(CapabilityError, match="ua_deterministic must be True or False"):
    declare("fn", fn)
