"""ua_kernels.attention with keys of another length, query offsets (static and
traced), the keys' own segment ids and attention sinks, against ua_reference
(docs/SEMANTICS.md): the Triton kernels in Pallas' interpreter, outputs and
every gradient, d sinks included; rows an offset leaves without keys give out
0 and lse -inf (the sink's value with one), never NaN."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ua_kernels
import ua_reference

B, HQ, HKV, D = 2, 4, 2, 16


def _vjp(f, q, k, v, sinks, **kw):
  def call(q, k, v, *s):
    return f(q, k, v, sinks=s[0] if s else None, return_lse=True, **kw)
  args = (q, k, v) + (() if sinks is None else (sinks,))
  out, lse = jax.eval_shape(call, *args)
  dout = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), out.dtype)
  dlse = jnp.asarray(np.random.default_rng(2).normal(size=lse.shape), jnp.float32)

  def run(*args):  # jitted: one compilation per call, where eager calls compile each op
    primal, vjp = jax.vjp(call, *args)
    return (*primal, *vjp((dout, dlse)))
  return [np.asarray(x, np.float64) for x in jax.jit(run)(*args)]


def _compare(tq, tk, sinks=None, dtype=jnp.float32, bound=2e-6, seed=0, **kw):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(B, tq, HQ, D)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(B, tk, HKV, D)), dtype) for _ in range(2))
  sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
  got = _vjp(ua_kernels.attention, q, k, v, sinks, **kw)
  want = _vjp(ua_reference.attention, q, k, v, sinks, **kw)
  for name, g, w in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
    finite = np.isfinite(w)
    np.testing.assert_array_equal(np.isfinite(g), finite, err_msg=name)
    err = np.abs(g[finite] - w[finite]).max(initial=0.0) / max(1.0, np.abs(w[finite]).max(
        initial=0.0))
    assert err < bound, (name, err)
  return got


CASES = {  # (Tq, Tk, keywords): float32, relative to the largest element (measured <= 5.1e-7)
    "decode": (1, 37, dict(causal=True)),
    "decode window": (5, 40, dict(causal=True, window_len=9)),
    "more queries than keys": (40, 21, dict(causal=True)),
    "negative offset": (20, 33, dict(q_offset=-4, causal=True, window_len=6)),
    "offset, equal lengths, z-loss": (17, 17, dict(q_offset=3, causal=True, z_loss_weight=0.1)),
    "cross-attention": (12, 29, dict()),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_kernels_match_the_reference(name):
  tq, tk, kw = CASES[name]
  _compare(tq, tk, **kw)


def test_the_keys_own_segment_ids():
  rng = np.random.default_rng(4)
  seg, kv_seg = (jnp.asarray(np.sort(rng.integers(0, 3, (B, n)), 1), jnp.int32) for n in (18, 30))
  _compare(18, 30, causal=True, segment_ids=seg, kv_segment_ids=kv_seg)


@pytest.mark.parametrize("dtype, bound", [(jnp.float32, 2e-6), (jnp.bfloat16, 2e-2)])
def test_sinks(dtype, bound):
  """d sinks too; a sink of -inf is none, and a row without keys has the sink as its lse."""
  _compare(33, 33, sinks=[0.5, -1.0, 2.0, 0.0], dtype=dtype, bound=bound, causal=True)
  _compare(1, 37, sinks=[0.5, -1.0, 6.0, -np.inf], dtype=dtype, bound=bound, causal=True,
           z_loss_weight=0.1)
  out, lse, *_ = _compare(8, 12, sinks=[0.5, -1.0, 6.0, 0.0], dtype=dtype, bound=bound,
                          causal=True, q_offset=-20)
  assert not out.any()
  np.testing.assert_array_equal(lse, np.broadcast_to(np.array([0.5, -1.0, 6.0, 0.0])[None, :,
                                                                                     None],
                                                     lse.shape))


def test_a_traced_offset_compiles_once_for_every_offset():
  rng = np.random.default_rng(5)
  q = jnp.asarray(rng.normal(size=(B, 4, HQ, D)), jnp.float32)
  k, v = (jnp.asarray(rng.normal(size=(B, 24, HKV, D)), jnp.float32) for _ in range(2))
  step = jax.jit(lambda q, k, v, o: ua_kernels.attention(q, k, v, q_offset=o, causal=True))
  for offset in (0, 7, 20):
    np.testing.assert_allclose(
        np.asarray(step(q, k, v, jnp.int32(offset))),
        np.asarray(ua_reference.attention(q, k, v, q_offset=offset, causal=True)),
        rtol=2e-6, atol=2e-6)
  assert step._cache_size() == 1
