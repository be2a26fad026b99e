"""The properties of queries and keys of other lengths and of sinks
(properties/checks/length_checks.py): each fails its planted bug, a defect of
the class it exists for, and passes the reference on the same case; the
suite draws the cases and judges its other properties on them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ua_reference
from properties.checks.checks import PropertyFailure
from properties.checks.registry import get
from properties.model.capabilities import declare
from properties.model.case import Case
from properties.model.inputs import make_inputs
from properties.model.strategies import cases
from properties.model.profiles import BUCKETS

REFERENCE = declare("ua_reference:attention", ua_reference.attention)


def _case(**kw):
  return Case(**{**dict(batch=2, num_q_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                        return_lse=True), **kw})


def decode_off_by_one(q, k, v, *, q_offset=None, **kw):
  """Fewer queries than keys placed one key early by default (Tk - Tq - 1)."""
  if q_offset is None and q.shape[1] < k.shape[1]:
    q_offset = k.shape[1] - q.shape[1] - 1
  return ua_reference.attention(q, k, v, q_offset=q_offset, **kw)


def lse_zero_without_keys(q, k, v, **kw):
  """A row without a visible key returns lse 0, not -inf."""
  out, lse = ua_reference.attention(q, k, v, **kw)
  return out, jnp.where(jnp.isneginf(lse), 0.0, lse)


def nan_where_no_key_and_no_sink(q, k, v, *, sinks=None, **kw):
  """exp(sink - max(row max, sink)) without a guard: -inf - (-inf) is NaN on
  a row without keys whose sink is -inf."""
  out, lse = ua_reference.attention(q, k, v, sinks=sinks, **kw)
  if sinks is None:
    return out, lse
  bad = jnp.isneginf(lse) & jnp.isneginf(sinks)[None, :, None]  # [B, Hq, Tq]
  return (jnp.where(jnp.transpose(bad, (0, 2, 1))[..., None], jnp.nan, out),
          jnp.where(bad, jnp.nan, lse))


def dsinks_without_the_lse_cotangent(q, k, v, *, sinks=None, **kw):
  """d sinks from the output alone: lse's cotangent (and a z-loss) never
  reaches the sinks, while dq, dk and dv stay right."""
  out, _ = ua_reference.attention(q, k, v, sinks=sinks, **kw)
  _, lse = ua_reference.attention(q, k, v, sinks=jax.lax.stop_gradient(sinks), **kw)
  return out, lse


PLANTED = {  # property: (planted bug, a case that shows it)
    "queries_equal_their_rows_of_the_full_call":
        (decode_off_by_one, _case(seq_len=5, kv_seq_len=37, causal=True)),
    "key_blocks_merge_to_one_call":
        (lse_zero_without_keys, _case(seq_len=40, kv_seq_len=21, causal=True)),
    "minus_inf_sinks_are_no_sinks":
        (nan_where_no_key_and_no_sink,
         _case(seq_len=20, kv_seq_len=33, q_offset=-6, causal=True, sinks="normal")),
    "sink_is_an_extra_key":
        (dsinks_without_the_lse_cotangent, _case(seq_len=9, kv_seq_len=33, sinks="large")),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_each_property_fails_its_planted_bug_and_passes_the_reference(name):
  fn, case = PLANTED[name]
  prop = get(name)
  assert case.invalid() is None and prop.applies(case)
  with pytest.raises(PropertyFailure):
    prop.check(declare(f"planted:{fn.__name__}", fn), case)
  assert prop.check(REFERENCE, case)


def test_the_full_call_holds_the_queries_at_their_positions():
  case = _case(seq_len=6, kv_seq_len=20, q_offset=9, segments="random", temperature="per_head")
  from properties.checks.length_checks import _full_call
  inputs = make_inputs(case)
  full_case, full = _full_call(case, inputs)
  assert (full_case.seq_len, full_case.tk, full_case.offset) == (20, 20, 0)
  np.testing.assert_array_equal(full["q"][:, 9:15], inputs["q"])
  np.testing.assert_array_equal(full["segment_ids"][:, 9:15], inputs["segment_ids"])
  np.testing.assert_array_equal(full["kv_segment_ids"], inputs["kv_segment_ids"])
  assert not full["dout"][:, :9].any() and not full["dlse"][..., 15:].any()
  assert full["temperature"].shape == (2, 20, 4)


def test_sink_channel_inputs_carry_the_sinks_as_a_keys_logit():
  case = _case(seq_len=5, sinks="normal", distribution="sink_channel", sm_scale=0.3,
               dtype="bfloat16")
  inputs = make_inputs(case)
  q, sinks = (np.asarray(inputs[n], np.float64) for n in ("q", "sinks"))
  assert not np.asarray(inputs["k"], np.float64)[..., -1].any()
  np.testing.assert_allclose(0.3 * q[..., -1], np.broadcast_to(sinks, q.shape[:-1]), rtol=1e-6)


def test_queries_and_keys_segment_ids_are_cut_from_one_layout():
  # A packed layout over every position queries and keys take: query i has
  # the id of key position i + offset wherever that is a key.
  for offset in (None, -4, 3, 30):
    case = _case(seq_len=12, kv_seq_len=25, q_offset=offset, segments="packed", seed=3)
    inputs = make_inputs(case)
    seg, kv = inputs["segment_ids"], inputs["kv_segment_ids"]
    assert seg.shape == (2, 12) and kv.shape == (2, 25)
    for i in range(12):
      if 0 <= i + case.offset < 25:
        np.testing.assert_array_equal(seg[:, i], kv[:, i + case.offset])


def test_cases_of_one_length_draw_what_they_drew_before():
  # A case file of one length without sinks names the inputs it named before
  # keys of other lengths and sinks existed: no new field in it, no new draw.
  case = _case(seq_len=33, segments="packed", temperature="uniform", seed=11)
  assert set(case.to_dict()) == {f.name for f in dataclasses.fields(Case)} - {
      "kv_seq_len", "q_offset", "sinks", "sampled_rows"}
  inputs = make_inputs(case)
  assert inputs["kv_segment_ids"] is None and inputs["sinks"] is None
  rng = np.random.default_rng(11)
  np.testing.assert_array_equal(inputs["q"], rng.normal(size=(2, 33, 4, 16)).astype(np.float32))


def test_the_strategy_draws_every_length_kind_offsets_and_sinks():
  from hypothesis import given, settings
  seen = set()

  @settings(max_examples=150, database=None, derandomize=True, deadline=None)
  @given(cases(BUCKETS["ci"], REFERENCE))
  def draw(case):
    assert case.invalid() is None
    seen.update(g for g in case.groups() if g.startswith("kv_length:"))
    seen.update(f for f in ("q_offset", "sinks", "kv_segment_ids") if f in case.features())

  draw()
  assert seen >= {"kv_length:decode", "kv_length:Tq<Tk", "kv_length:Tq>Tk", "q_offset", "sinks",
                  "kv_segment_ids"}, seen


def test_a_kernel_without_the_keywords_is_judged_on_one_length():
  def plain(q, k, v, *, segment_ids=None, causal=False, **kw):
    return ua_reference.attention(q, k, v, segment_ids=segment_ids, causal=causal, **kw)

  def narrow(q, k, v, *, segment_ids=None, causal=False, window_len=0):
    return ua_reference.attention(q, k, v, segment_ids=segment_ids, causal=causal)

  def swallowing(q, k, v, **unsupported):  # **kwargs names no keyword
    return ua_reference.attention(q, k, v, **unsupported)

  import functools
  wrapped = functools.wraps(ua_reference.attention)(lambda *a, **kw: None)
  new = {"kv_length", "q_offset", "kv_segment_ids", "sinks"}
  for fn in (plain, narrow, swallowing):
    impl = declare(fn.__name__, fn)
    assert new <= impl.unsupported and impl.unsigned == new, fn.__name__
  assert "takes no" in impl.lacks({"sinks"}) and "declares" not in impl.lacks({"sinks"})
  assert get("sink_is_an_extra_key").unsupported_by(impl)
  assert not declare("wrapped", wrapped).unsupported  # functools.wraps: its target's keywords
  assert not declare("triton", __import__("ua_kernels.backends").backends.triton_attention
                     ).unsupported
