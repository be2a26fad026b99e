"""Capability declarations (properties/model/capabilities.py): read, checked, and
honoured by the strategies."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings

from properties.model.capabilities import CapabilityError, declare
from properties.model.profiles import PROFILES
from properties.model.strategies import cases


def _fn(**attrs):
  def attention(q, k, v, **kwargs):
    raise AssertionError("not called")
  for name, value in attrs.items():
    setattr(attention, name, value)
  return attention


@pytest.mark.parametrize("attrs, message", [
    (dict(ua_unsuported={"cap"}), "unknown attributes \\['ua_unsuported'\\]"),
    (dict(ua_unsupported={"caps"}), "unknown features \\['caps'\\]"),
    (dict(ua_dtypes=("float64",)), "ua_dtypes must name some of"),
    (dict(ua_dtypes=()), "ua_dtypes must name some of"),
    (dict(ua_head_dims=(64, "128")), "positive ints"),
    (dict(ua_head_dims=5), "collection of ints or a predicate"),
    (dict(ua_block_sizes=(64, 0)), "positive ints"),
    (dict(ua_block_sizes=64), "tuple of ints"),
    (dict(ua_config=(64, 64)), "ua_config must be callable"),
    # A lone string is not read as its letters.
    (dict(ua_unsupported="causal"), "ua_unsupported must be a collection of feature names, "
                                    "not the string 'causal'"),
    (dict(ua_dtypes="float32"), "ua_dtypes must be a collection of dtype names, not the string"),
    (dict(ua_block_sizes="64"), "tuple of ints"),
    (dict(ua_seq_len_multiple=0), "ua_seq_len_multiple must be a positive int"),
    (dict(ua_seq_len_multiple=4.0), "ua_seq_len_multiple must be a positive int"),
    (dict(ua_unsharded="ua_kernels.attention"), "ua_unsharded must name the single-device op"),
    (dict(ua_unsharded=print), "ua_unsharded must name the single-device op"),
])
def test_bad_declarations_are_errors(attrs, message):
  with pytest.raises(CapabilityError, match=message):
    declare("mod:attention", _fn(**attrs))


def _drawn(impl, n=150, **kwargs):
  seen = []

  @settings(max_examples=n, derandomize=True, database=None, deadline=None,
            suppress_health_check=list(HealthCheck))
  @given(cases(PROFILES["ci"].buckets, impl, **kwargs))
  def collect(case):
    seen.append(case)

  collect()
  return seen


def test_strategies_honour_dtypes_head_dims_and_features():
  impl = declare("mod:attention", _fn(ua_dtypes=("bfloat16",), ua_head_dims=lambda d: d % 16 == 0,
                                      ua_unsupported={"window", "gqa"}))
  drawn = _drawn(impl)
  assert {c.dtype for c in drawn} == {"bfloat16"}
  assert all(c.head_dim % 16 == 0 and not c.window_len and c.num_q_heads == c.num_kv_heads
             for c in drawn)
  assert all(c.tiles is None for c in drawn)  # it takes no config


def test_declared_block_sizes_put_lengths_and_windows_at_tile_edges():
  """Every profile, ci included, draws k*b - 1, k*b and k*b + 1 for k up to 3."""
  impl = declare("mod:attention", _fn(ua_block_sizes=(64,)))
  drawn = _drawn(impl, n=400, require=frozenset({"window"}))
  lengths = {c.seq_len for c in drawn}
  assert {63, 64, 65, 127, 128, 129, 191, 192, 193} <= lengths, sorted(lengths)
  windows = {c.window_len for c in drawn}
  assert {63, 64, 65, 127, 128, 129} <= windows, sorted(windows)


def test_a_declared_length_multiple_is_drawn_and_required():
  """A sharded op takes lengths that are multiples of twice its shards: drawn
  lengths are rounded up to one, and any other case is declared unsupported."""
  impl = declare("mod:attention", _fn(ua_seq_len_multiple=8))
  drawn = _drawn(impl)
  assert all(c.seq_len % 8 == 0 for c in drawn), sorted({c.seq_len for c in drawn})
  assert len({c.seq_len for c in drawn}) > 3
  assert "multiples of 8" in impl.supports(dataclasses.replace(drawn[0], seq_len=12))
  assert impl.supports(dataclasses.replace(drawn[0], seq_len=16)) is None


def test_a_config_gets_the_drawn_tiles():
  made = []
  impl = declare("mod:attention", _fn(ua_config=lambda bq, bkv: made.append((bq, bkv)) or "cfg"))
  drawn = _drawn(impl)
  tiles = {c.tiles for c in drawn}
  assert {(16, 16), (32, 16), (16, 32)} <= tiles
  case = next(c for c in drawn if c.tiles is not None)
  assert impl.call_kwargs(case)["config"] == "cfg" and made[-1] == case.tiles


def _first_example(strategy):
  """The case a derandomized test draws first: Hypothesis's simplest one."""
  from hypothesis import Phase
  seen = []

  @settings(database=None, max_examples=1, derandomize=True, phases=[Phase.generate],
            deadline=None)
  @given(strategy)
  def run(case):
    seen.append(case)

  run()
  return seen[0]


def test_chunks_of_a_campaign_start_from_different_configurations():
  """Every chunk of a test starts from Hypothesis's simplest example; rotated
  choices make those first cases distinct configurations across the gpu
  profile's chunks, one of them long, while chunk 0 keeps the realistic one."""
  import dataclasses

  from properties.model.capabilities import load_impl
  impl = load_impl("ua_kernels:attention")
  profile = PROFILES["gpu"]
  buckets = dataclasses.replace(profile.buckets, dtypes=("bfloat16",))
  firsts = [_first_example(cases(buckets, impl, rotation=k))
            for k in range(profile.oracle_chunks)]
  assert (firsts[0].seq_len, firsts[0].head_dim) == (buckets.seq_lens[0], buckets.head_dims[0])
  assert len({c.static_digest() for c in firsts}) == len(firsts)
  assert any(c.seq_len >= buckets.long_seq for c in firsts)


def test_a_document_alone_is_padded_to_a_declared_length_multiple():
  """packed_equals_separate runs each document alone; for an implementation
  that takes only multiples of 4 (as a sharded op over 2 devices), a document
  of 1 or 3 tokens runs padded to 4 with the padding a document of its own,
  and the property still compares every document's rows."""
  import jax.numpy as jnp
  import ua_reference
  from properties.checks import checks
  from properties.model.case import Case

  lengths = []

  def attention(q, k, v, **kwargs):
    lengths.append(q.shape[1])
    if q.shape[1] % 4:
      raise ValueError(f"the sequence length ({q.shape[1]}) must be a multiple of 4")
    return ua_reference.attention(q, k, v, **kwargs)

  attention.ua_seq_len_multiple = 4
  impl = declare("mod:attention", attention)
  case = Case(batch=1, seq_len=8, num_q_heads=2, num_kv_heads=1, head_dim=16, dtype="float32",
              segments="packed", seed=3)
  seg = checks.make_inputs(case)["segment_ids"][0]
  assert any(n % 4 for n in jnp.unique(jnp.asarray(seg), return_counts=True)[1].tolist())
  errors = checks.packed_equals_separate(impl, case)
  assert errors and all(e.ok for e in errors)
  assert all(t % 4 == 0 for t in lengths) and 4 in lengths


def test_a_sharded_op_is_checked_against_its_unsharded_counterpart():
  """sharded_equals_unsharded runs only for an implementation that names its
  single-device counterpart (ua_unsharded); it passes the same op and fails one
  whose shards forget each other's keys (each half of the sequence attends
  only to its own half), a ring that never turns."""
  import jax.numpy as jnp
  import ua_reference
  from properties.checks import checks
  from properties.model.case import Case
  from properties.checks.registry import get

  def whole(q, k, v, **kwargs):
    return ua_reference.attention(q, k, v, **kwargs)

  def halves(q, k, v, **kwargs):
    h = q.shape[1] // 2
    parts = [ua_reference.attention(q[:, s], k[:, s], v[:, s], **kwargs)
             for s in (slice(0, h), slice(h, None))]
    return jnp.concatenate(parts, axis=1)

  prop = get("sharded_equals_unsharded")
  assert "declares no ua_unsharded" in prop.unsupported_by(declare("mod:attention", whole))
  case = Case(batch=1, seq_len=8, num_q_heads=2, num_kv_heads=2, head_dim=16, dtype="float32",
              seed=5)
  for fn in (whole, halves):
    fn.ua_unsharded = "ua_reference:attention"
  impl = declare("mod:whole", whole)
  assert prop.unsupported_by(impl) is None
  errors = checks.sharded_equals_unsharded(impl, case)
  assert errors and all(e.ok for e in errors)
  with pytest.raises(checks.PropertyFailure, match="mod:halves differs from ua_reference:attention"):
    checks.sharded_equals_unsharded(declare("mod:halves", halves), case)
