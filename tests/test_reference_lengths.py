"""ua_reference with queries and keys of different lengths, query offsets, the
keys' own segment ids and attention sinks (docs/SEMANTICS.md): against
brute-force loops, and the metamorphic identities the suite's properties will
hold every implementation to (decode rows are prefill rows, a chunked prefill
is one call, sinks of -inf are none, a sink is an extra key of value zero)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import ua_reference
from properties.judge.runner import x64


def brute_force(q, k, v, *, offset, seg=None, kv_seg=None, causal=False, window=0,
                sinks=None):
  """Direct loops over (b, h, i, j) in float64: the contract, read literally."""
  b_, tq, hq, d = q.shape
  tk, g = k.shape[1], hq // k.shape[2]
  out = np.zeros(q.shape)
  lse = np.full((b_, hq, tq), -np.inf)
  for b in range(b_):
    for h in range(hq):
      for i in range(tq):
        at = i + offset
        logits, vals = [], []
        for j in range(tk):
          if seg is not None and seg[b, i] != kv_seg[b, j]:
            continue
          if (causal and j > at) or (window and not j > at - window):
            continue
          logits.append(float(np.dot(q[b, i, h], k[b, j, h // g])) / math.sqrt(d))
          vals.append(v[b, j, h // g])
        if sinks is not None:  # one more logit, of value zero
          logits.append(sinks[h])
          vals.append(np.zeros(d))
        if logits and max(logits) > -np.inf:
          m = max(logits)
          w = np.exp(np.array(logits) - m)
          lse[b, h, i] = m + math.log(w.sum())
          out[b, i, h] = (w[:, None] * np.array(vals)).sum(0) / w.sum()
  return out, lse


def _qkv(seed=0, b=2, tq=5, tk=9, hq=4, hkv=2, d=4):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(b, tq, hq, d)), rng.normal(size=(b, tk, hkv, d)),
          rng.normal(size=(b, tk, hkv, d)))


def _run(q, k, v, **kw):
  with x64(True):
    out, lse = ua_reference.attention(*(jnp.asarray(x) for x in (q, k, v)), return_lse=True,
                                      **kw)
    return np.asarray(out), np.asarray(lse)


SEG = np.array([[0, 0, 1, 1, 1], [3, 3, 3, 7, 7]])
KV_SEG = np.array([[0, 0, 0, 0, 1, 1, 1, 2, 2], [3, 7, 7, 7, 7, 7, 3, 3, 3]])
CLAUSES = {  # Tq = 5 queries against Tk = 9 keys
    "bottom-right": {},
    "causal": {"causal": True},
    "causal offset 2": {"causal": True, "q_offset": 2},
    "negative offset: rows without keys": {"causal": True, "q_offset": -3},
    "offset past the keys": {"causal": True, "q_offset": 20},
    "window": {"window_len": 3},
    "causal window offset": {"causal": True, "window_len": 2, "q_offset": 1},
    "segments": {"segment_ids": SEG, "kv_segment_ids": KV_SEG, "causal": True},
    "sinks": {"sinks": np.array([0.5, -1.0, 3.0, -np.inf])},
    "sinks and rows without keys": {"causal": True, "q_offset": -3,
                                    "sinks": np.array([0.5, -1.0, 3.0, 0.0])},
    "everything": {"causal": True, "window_len": 4, "q_offset": 3, "segment_ids": SEG,
                   "kv_segment_ids": KV_SEG, "sinks": np.array([1.0, 0.0, -2.0, 0.25])},
}


@pytest.mark.parametrize("clause", sorted(CLAUSES))
def test_reference_matches_brute_force(clause):
  kw = dict(CLAUSES[clause])
  q, k, v = _qkv()
  want_out, want_lse = brute_force(
      q, k, v, offset=kw.get("q_offset", 9 - 5), seg=kw.get("segment_ids"),
      kv_seg=kw.get("kv_segment_ids"), causal=kw.get("causal", False),
      window=kw.get("window_len", 0), sinks=kw.get("sinks"))
  out, lse = _run(q, k, v, **{n: jnp.asarray(x) if isinstance(x, np.ndarray) else x
                              for n, x in kw.items()})
  np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
  np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
  np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)


def test_a_row_without_keys_has_the_sink_as_its_lse_and_zero_output():
  q, k, v = _qkv()
  sinks = np.array([0.5, -1.0, 3.0, 0.0])
  out, lse = _run(q, k, v, causal=True, q_offset=-100, sinks=jnp.asarray(sinks))
  assert not out.any()
  np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], lse.shape))


def test_decode_rows_are_the_last_rows_of_the_prefill():
  q, k, v = _qkv(tq=9)
  kw = dict(causal=True, window_len=5, segment_ids=KV_SEG)
  full_out, full_lse = _run(q, k, v, **kw)
  for n in (1, 3):
    out, lse = _run(q[:, -n:], k, v, causal=True, window_len=5,
                    segment_ids=KV_SEG[:, -n:], kv_segment_ids=KV_SEG)
    np.testing.assert_allclose(out, full_out[:, -n:], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(lse, full_lse[..., -n:], rtol=1e-13, atol=1e-14)


def test_a_chunked_prefill_is_one_call():
  """Queries in two chunks at their offsets, and keys in two blocks merged
  through their lse, give the one call's out and lse."""
  q, k, v = _qkv(tq=9)
  sinks = np.array([0.5, -1.0, 3.0, 0.0])
  kw = dict(causal=True, window_len=6)
  full_out, full_lse = _run(q, k, v, sinks=jnp.asarray(sinks), **kw)
  a = 4
  first = _run(q[:, :a], k[:, :a], v[:, :a], sinks=jnp.asarray(sinks), **kw)
  second = _run(q[:, a:], k, v, sinks=jnp.asarray(sinks), **kw)  # q_offset Tk - Tq = a
  np.testing.assert_allclose(np.concatenate([first[0], second[0]], 1), full_out, rtol=1e-13,
                             atol=1e-14)
  np.testing.assert_allclose(np.concatenate([first[1], second[1]], 2), full_lse, rtol=1e-13)
  # Keys split at s: each block's queries sit at q_offset - s among its keys; the sink
  # joins one block's softmax only.
  s = 5
  lo = _run(q, k[:, :s], v[:, :s], q_offset=0, sinks=jnp.asarray(sinks), **kw)
  hi = _run(q, k[:, s:], v[:, s:], q_offset=-s, **kw)
  lse = np.logaddexp(lo[1], hi[1])
  weight = lambda part: np.exp(np.transpose(part[1] - lse, (0, 2, 1)))[..., None]
  out = weight(lo) * lo[0] + np.nan_to_num(weight(hi)) * hi[0]
  np.testing.assert_allclose(out, full_out, rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(lse, full_lse, rtol=1e-13)


def _vjp(q, k, v, sinks, pad_dout=0, **kw):
  """out, lse and every cotangent, under output cotangents drawn for q's head
  dim less ``pad_dout`` (the padded columns' cotangent 0)."""
  rng = np.random.default_rng(7)
  with x64(True):
    args = [jnp.asarray(x) for x in (q, k, v)] + ([] if sinks is None else [jnp.asarray(sinks)])

    def f(q, k, v, *s):
      return ua_reference.attention(q, k, v, sinks=s[0] if s else None, return_lse=True, **kw)
    out, lse = jax.eval_shape(f, *args)
    dout = rng.normal(size=out.shape[:3] + (out.shape[3] - pad_dout,))
    dout = np.concatenate([dout, np.zeros(out.shape[:3] + (pad_dout,))], -1)
    cot = (jnp.asarray(dout), jnp.asarray(rng.normal(size=lse.shape)))

    def run(*args):  # jitted: one compilation per call, where eager calls compile each op
      primal, vjp = jax.vjp(f, *args)
      return (*primal, *vjp(cot))
    return [np.asarray(x) for x in jax.jit(run)(*args)]


def test_sinks_of_minus_infinity_are_no_sinks():
  q, k, v = _qkv()
  kw = dict(causal=True, window_len=3, z_loss_weight=0.1)
  with_sinks = _vjp(q, k, v, np.full(4, -np.inf), **kw)
  without = _vjp(q, k, v, None, **kw)
  for a, b in zip(with_sinks, without):
    np.testing.assert_array_equal(a, b)
  assert not with_sinks[-1].any()  # d sinks: exp(-inf - lse) = 0, never NaN


def test_a_sink_is_an_extra_key_whose_logit_is_the_sink_and_whose_value_is_zero():
  """One head dimension more: queries read 1 there, real keys 0, and an extra
  key at position 0 holds the sink there (and 0 elsewhere), so its logit is
  exactly the sink (sm_scale 1); the queries' offset of 1 lets every query see
  it under the causal mask. d sinks is that key's gradient in that dimension."""
  b, t, h, d = 2, 6, 3, 4
  rng = np.random.default_rng(3)
  q, k, v = (rng.normal(size=(b, t, h, d)) for _ in range(3))
  sinks = np.array([0.7, -2.0, 4.0])
  kw = dict(causal=True, z_loss_weight=0.2, sm_scale=1.0)  # no window: it would hide the key
  out, lse, dq, dk, dv, dsinks = _vjp(q, k, v, sinks, **kw)

  extra = np.zeros((b, 1, h, d + 1))
  extra[..., d] = sinks
  q1 = np.concatenate([q, np.ones((b, t, h, 1))], -1)
  k1 = np.concatenate([extra, np.concatenate([k, np.zeros((b, t, h, 1))], -1)], 1)
  v1 = np.concatenate([np.zeros((b, 1, h, d + 1)),
                       np.concatenate([v, np.zeros((b, t, h, 1))], -1)], 1)
  kw1 = dict(kw, q_offset=1)
  out1, lse1, dq1, dk1, dv1 = _vjp(q1, k1, v1, None, pad_dout=1, **kw1)
  assert not out1[..., d].any()
  np.testing.assert_allclose(out, out1[..., :d], rtol=1e-12, atol=1e-13)
  np.testing.assert_allclose(lse, lse1, rtol=1e-12)
  np.testing.assert_allclose(dq, dq1[..., :d], rtol=1e-11, atol=1e-12)
  np.testing.assert_allclose(dk, dk1[:, 1:, :, :d], rtol=1e-11, atol=1e-12)
  np.testing.assert_allclose(dv, dv1[:, 1:, :, :d], rtol=1e-11, atol=1e-12)
  np.testing.assert_allclose(dsinks, dk1[:, 0, :, d].sum(0), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_check_grads_of_sinks_and_offsets_float64(seed):
  """Autodiff against finite differences (no z-loss: its gradient is the contract's, not
  the function's; test_a_sink_is_an_extra_key_... covers d sinks under it)."""
  q, k, v = _qkv(seed, b=1, tq=3, tk=6, hq=2, hkv=1, d=3)
  rng = np.random.default_rng(seed)
  sinks = rng.normal(size=2)
  with x64(True):
    def f(q, k, v, s):
      o, l = ua_reference.attention(q, k, v, sinks=s, causal=True, q_offset=seed + 1,
                                    window_len=2 + seed, return_lse=True)
      return o, jnp.where(jnp.isfinite(l), l, 0.0)
    check_grads(f, [jnp.asarray(x) for x in (q, k, v, sinks)], order=1, modes=["rev"],
                atol=1e-6, rtol=1e-6)


def test_a_traced_offset_is_the_static_one():
  q, k, v = (jnp.asarray(x, jnp.float32) for x in _qkv())
  kw = dict(causal=True, window_len=3)
  static = ua_reference.attention(q, k, v, q_offset=2, **kw)
  traced = jax.jit(lambda q, k, v, o: ua_reference.attention(q, k, v, q_offset=o, **kw))(
      q, k, v, jnp.int32(2))
  np.testing.assert_array_equal(np.asarray(static), np.asarray(traced))


def test_query_row_blocks_keep_the_offsets_and_sinks(monkeypatch):
  """Long sequences run in blocks of query rows: the blocks keep every query's
  position (q_offset), the keys' segments and the sinks."""
  from ua_reference import reference
  q, k, v = _qkv(tq=7, tk=11)
  rng = np.random.default_rng(2)
  seg, kv_seg = (np.sort(rng.integers(0, 2, size=(2, n)), axis=1) for n in (7, 11))
  kw = dict(causal=True, window_len=5, q_offset=3, segment_ids=jnp.asarray(seg),
            kv_segment_ids=jnp.asarray(kv_seg), sinks=jnp.asarray(rng.normal(size=4)))
  whole = _run(q, k, v, **kw)
  monkeypatch.setattr(reference, "MAX_LOGITS", 2 * 4 * 11 * 3)  # 3 query rows per block
  blocked = _run(q, k, v, **kw)
  for a, b in zip(whole, blocked):
    np.testing.assert_allclose(a, b, rtol=1e-13, atol=1e-14)


def test_wide_segment_ids_keep_one_rank_on_both_sides():
  """Ids wider than int32 are compared by rank: ranked over the queries' and the
  keys' together (each side alone, a query's lone id 2^40 + 9 ranked 0)."""
  q, k, v = _qkv(tq=1)
  wide = lambda x: np.asarray(x, np.int64) + (1 << 40)
  kw = dict(causal=True)
  want = _run(q, k, v, segment_ids=jnp.asarray(SEG[:, -1:]), kv_segment_ids=jnp.asarray(
      np.array([[0, 0, 0, 0, 1, 1, 1, 1, 1], [3, 7, 7, 7, 7, 7, 3, 3, 7]])), **kw)
  got = _run(q, k, v, segment_ids=wide(SEG[:, -1:]), kv_segment_ids=wide(
      [[0, 0, 0, 0, 1, 1, 1, 1, 1], [3, 7, 7, 7, 7, 7, 3, 3, 7]]), **kw)
  assert np.isfinite(want[1]).all()
  for a, b in zip(want, got):
    np.testing.assert_array_equal(a, b)


def test_d_sinks_is_the_closed_form_of_semantics_md():
  """dsinks[h] = sum_{b,i} exp(s[h] - lse) * (dlse + w * lse - <dout, out>)."""
  q, k, v = _qkv(tq=4, tk=7)
  sinks, w = np.array([0.3, -0.5, 1.5, 0.0]), 0.25
  rng = np.random.default_rng(7)  # _vjp's cotangents
  out, lse, *_, dsinks = _vjp(q, k, v, sinks, causal=True, q_offset=1, z_loss_weight=w)
  dout, dlse = rng.normal(size=out.shape), rng.normal(size=lse.shape)
  p_sink = np.exp(sinks[None, :, None] - lse)
  delta = np.transpose(np.einsum("bihd,bihd->bih", dout, out), (0, 2, 1))
  np.testing.assert_allclose(dsinks, (p_sink * (dlse + w * lse - delta)).sum((0, 2)),
                             rtol=1e-12)
