"""Implementations from "outside" the project, for the suite's own tests: each
is a plain function with the contract's signature and ``ua_*`` declarations,
loaded by the suite as ``outside_kernels:<name>`` (tests put this directory on
PYTHONPATH), as a user's kernel would be.
"""

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import ua_reference

TILE = 64


def window_bug_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                         cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                         z_loss_weight=0.0, return_lse=False):
  """Attention over 64-row tiles whose window's first key tile is counted back
  from the last visited tile: ``lo = max(hi - (W + 64) // 64, 0)`` (the
  original kernel's defect O3, docs/DEFECTS.md). With causal the last tile is
  the query's own and the bound is nearly right; without it the last tile is
  the sequence's last, and queries more than a tile or two from the end lose
  keys they can see. Only sequences crossing three 64-row tiles show it."""
  b, t, hq, d = q.shape
  g = hq // k.shape[2]
  sm = d ** -0.5 if sm_scale is None else sm_scale
  kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
  logits = sm * jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kr.astype(jnp.float32))
  mask = ua_reference.visible_keys(t, None, causal, window_len)[0]
  if window_len > 0:
    i, j = jnp.arange(t), jnp.arange(t)
    n_tiles = -(-t // TILE)
    hi = (i // TILE + 1) if causal else jnp.full((t,), n_tiles)
    lo = jnp.maximum(hi - (window_len + TILE) // TILE, 0)
    mask = mask & (j[None, :] // TILE >= lo[:, None])
  logits = jnp.where(mask, logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", probs, vr.astype(jnp.float32)).astype(q.dtype)


window_bug_attention.ua_unsupported = {"segment_ids", "cap", "temperature", "z_loss", "lse"}
window_bug_attention.ua_block_sizes = (TILE,)


def _reference_unless(condition, action):
  def attention(q, k, v, **kwargs):
    if condition(q):
      action()
    return ua_reference.attention(q, k, v, **kwargs)
  return attention


def _die():
  os._exit(134)  # what an illegal address or an abort does to the worker


def _hang():
  time.sleep(3600)


# Correct but for sequences longer than 16, where the process dies / hangs.
crashing_attention = _reference_unless(lambda q: q.shape[1] > 16, _die)
hanging_attention = _reference_unless(lambda q: q.shape[1] > 16, _hang)


def off_when_capped_attention(q, k, v, **kwargs):
  """The reference, 1e-3 off whenever a cap is used."""
  out = ua_reference.attention(q, k, v, **kwargs)
  if kwargs.get("cap_method", "none") == "none":
    return out
  if kwargs.get("return_lse"):
    return out[0] * 1.001, out[1]
  return out * 1.001


def tanh_only_attention(q, k, v, **kwargs):
  """The reference, declaring the tanh cap as the only cap method it supports."""
  return ua_reference.attention(q, k, v, **kwargs)


tanh_only_attention.ua_cap_methods = ("tanh",)


def dk_off_when_causal_attention(q, k, v, **kwargs):
  """The reference with dk 1.5 times too large on causal sequences longer than 16, and
  right everywhere else (out, lse, dq, dv; every other case): the planted
  defect tests/test_minimize.py reduces. The forward adds k - stop_gradient(k),
  exactly zero, so only k's cotangent changes."""
  if kwargs.get("causal") and q.shape[1] > 16:
    k = k + 0.5 * (k - jax.lax.stop_gradient(k))
  return ua_reference.attention(q, k, v, **kwargs)


def _bfloat16_out(q, k, v, kwargs, round_bits):
  """The reference computed in float32 with its out rounded to bfloat16 by
  ``round_bits`` (float32 bits -> float32 bits, exact in bfloat16); the
  gradient passes as the identity's."""
  wide = ua_reference.attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                v.astype(jnp.float32), **kwargs)
  out, rest = (wide[0], wide[1:]) if isinstance(wide, tuple) else (wide, ())
  bits = round_bits(jax.lax.bitcast_convert_type(out, jnp.uint32))
  rounded = jax.lax.bitcast_convert_type(bits, jnp.float32)
  out = (out + jax.lax.stop_gradient(rounded - out)).astype(jnp.bfloat16)
  return (out, *rest) if rest else out


@functools.wraps(ua_reference.attention)
def coarse_reference_attention(q, k, v, **kwargs):
  """The reference whose bfloat16 out is rounded to nearest at 7 significant
  bits, not 8: twice the rounding error, far inside the bound
  (tests/test_gates.py's precision regression)."""
  if q.dtype != jnp.bfloat16:
    return ua_reference.attention(q, k, v, **kwargs)
  # to nearest, ties to even, at bit 17
  return _bfloat16_out(q, k, v, kwargs, lambda b: (
      b + jnp.uint32(0xFFFF) + ((b >> 17) & jnp.uint32(1))) & jnp.uint32(0xFFFE0000))


@functools.wraps(ua_reference.attention)
def toward_zero_reference_attention(q, k, v, **kwargs):
  """The reference whose bfloat16 out is rounded toward zero instead of to
  nearest: within one ulp of every element, every element biased toward zero."""
  if q.dtype != jnp.bfloat16:
    return ua_reference.attention(q, k, v, **kwargs)
  return _bfloat16_out(q, k, v, kwargs, lambda b: b & jnp.uint32(0xFFFF0000))


# --------------------------------------------------------------------------- #
# Kernels shaped unlike ours: narrow declarations, 128-row tiles, captured arrays.

BLOCK = 128


def _blockwise(q, k, v, segment_ids, causal, window_len, cap_method, cap_params, sm_scale,
               causal_shift=0):
  """Online-softmax attention over 128-key tiles, T padded to them with a
  document of its own, as a client's blockwise kernel is written;
  ``causal_shift`` moves the causal bound (a planted off-by-one when 1)."""
  b, t, hq, d = q.shape
  if d not in (128, 256):
    raise ValueError(f"head dim {d}: this kernel takes 128 or 256")
  g = hq // k.shape[2]
  tp = -(-t // BLOCK) * BLOCK
  pad = lambda x: jnp.pad(x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2))
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  seg = jnp.concatenate([seg, jnp.full((b, tp - t), jnp.iinfo(jnp.int32).min, jnp.int32)], 1)
  real = jnp.arange(tp) < t
  qf = pad(q).astype(jnp.float32) * (d ** -0.5 if sm_scale is None else sm_scale)
  kf, vf = (jnp.repeat(pad(x), g, axis=2).astype(jnp.float32) for x in (k, v))
  i = jnp.arange(tp)[:, None]
  m = jnp.full((b, hq, tp), -jnp.inf)
  l = jnp.zeros((b, hq, tp))
  acc = jnp.zeros((b, hq, tp, d))
  for start in range(0, tp, BLOCK):
    j = jnp.arange(start, start + BLOCK)[None, :]
    s = jnp.einsum("bqhd,bkhd->bhqk", qf, kf[:, start:start + BLOCK])
    if cap_method == "tanh":
      s = cap_params[0] * jnp.tanh(s / cap_params[0])
    vis = (seg[:, :, None] == seg[:, None, start:start + BLOCK]) & (real[:, None] == real[None, start:start + BLOCK])
    if causal:
      vis = vis & (j <= i + causal_shift)
    if window_len:
      vis = vis & (j > i - window_len)
    s = jnp.where(vis[:, None], s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - safe[..., None])
    scale = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))
    l = l * scale + p.sum(-1)
    acc = acc * scale[..., None] + jnp.einsum("bhqk,bkhd->bhqd", p, vf[:, start:start + BLOCK])
    m = m_new
  out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
  return jnp.transpose(out, (0, 2, 1, 3))[:, :t].astype(q.dtype)


def narrow_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                     cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                     z_loss_weight=0.0, return_lse=False):
  """A correct client kernel of narrow declarations: D 128 or 256, 128-row
  tiles, bfloat16, no temperature, z-loss or lse, the tanh cap only."""
  return _blockwise(q, k, v, segment_ids, causal, window_len, cap_method, cap_params,
                    sm_scale)


def narrow_off_by_one_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                                cap_method="none", cap_params=(), temperature=None,
                                sm_scale=None, z_loss_weight=0.0, return_lse=False):
  """narrow_attention whose causal bound lets each query see the next key."""
  return _blockwise(q, k, v, segment_ids, causal, window_len, cap_method, cap_params,
                    sm_scale, causal_shift=1)


for _fn in (narrow_attention, narrow_off_by_one_attention):
  _fn.ua_head_dims = (128, 256)
  _fn.ua_block_sizes = (BLOCK,)
  _fn.ua_dtypes = ("bfloat16",)
  _fn.ua_unsupported = ("temperature", "z_loss", "lse")
  _fn.ua_cap_methods = ("tanh",)

# Device arrays captured by the callables below, as a kernel holds mask tables
# or a model its RoPE tables: the compiled computation takes them as operands.
_ONES = jnp.ones((4096,), jnp.float32)
_TWO = jnp.full((3,), 2.0, jnp.float32)


def closure_attention(q, k, v, **kwargs):
  """The reference with q multiplied by captured ones (and a captured 2 / 2)."""
  scale = (_ONES[:q.shape[1]] * _TWO[0] / 2.0).astype(q.dtype)
  return ua_reference.attention(q * scale[None, :, None, None], k, v, **kwargs)


@functools.partial(jax.jit, static_argnames=("causal", "window_len", "cap_method",
                                             "cap_params", "sm_scale", "z_loss_weight",
                                             "return_lse"))
def _jitted(q, k, v, segment_ids, temperature, **kwargs):
  return closure_attention(q, k, v, segment_ids=segment_ids, temperature=temperature, **kwargs)


def inner_jit_attention(q, k, v, *, segment_ids=None, temperature=None, **kwargs):
  """An inner jax.jit with static arguments, over the captured arrays."""
  return _jitted(q, k, v, segment_ids, temperature, **kwargs)


def inner_vmap_attention(q, k, v, *, segment_ids=None, temperature=None, **kwargs):
  """The batch mapped by jax.vmap, one row at a time, over the captured arrays."""
  b = q.shape[0]
  temp = None if temperature is None else jnp.broadcast_to(
      jnp.asarray(temperature, jnp.float32), (b, q.shape[1], q.shape[2]))

  def row(q, k, v, seg, tmp):
    return closure_attention(q[None], k[None], v[None],
                             segment_ids=None if seg is None else seg[None],
                             temperature=None if tmp is None else tmp[None], **kwargs)
  out = jax.vmap(row)(q, k, v, segment_ids, temp)
  squeeze = lambda x: x[:, 0]
  return jax.tree_util.tree_map(squeeze, out)


def custom_vjp_attention(q, k, v, **kwargs):
  """Its own custom_vjp (the reference's VJP, recomputed), over the captured arrays."""
  @jax.custom_vjp
  def f(q, k, v):
    return closure_attention(q, k, v, **kwargs)

  def fwd(q, k, v):
    return f(q, k, v), (q, k, v)

  def bwd(res, ct):
    return jax.vjp(lambda *a: closure_attention(*a, **kwargs), *res)[1](ct)
  f.defvjp(fwd, bwd)
  return f(q, k, v)


def head_dim_above_128_halved_attention(q, k, v, **kwargs):
  """The reference with q's head-dim columns above 128 at half weight."""
  d = q.shape[-1]
  w = jnp.where(jnp.arange(d) >= 128, 0.5, 1.0).astype(q.dtype)
  return ua_reference.attention(q * w, k, v, **kwargs)


def int32_offsets_attention(q, k, v, **kwargs):
  """ua_kernels' attention on q read back through flat element offsets held in
  int32, ((b * T + t) * H + h) * D + d: exact below 2^31 elements, past them
  the offsets wrap and the rows beyond read other rows' values (the index
  overflow class of FlashAttention #407; docs/MUTATION.md, "Production scale")."""
  import ua_kernels
  b, t, h, d = (jnp.arange(n, dtype=jnp.int32) for n in q.shape)
  _, length, heads, dim = (jnp.int32(n) for n in q.shape)
  flat = ((b[:, None, None, None] * length + t[None, :, None, None]) * heads
          + h[None, None, :, None]) * dim + d[None, None, None, :]
  q = jnp.take(q.reshape(-1), flat, mode="wrap")
  return ua_kernels.attention(q, k, v, **kwargs)


def segment_ids_8_bit_attention(q, k, v, *, segment_ids=None, **kwargs):
  """The reference with segment ids narrowed to their low 8 bits."""
  if segment_ids is not None:
    segment_ids = jnp.asarray(segment_ids) & 0xFF
  return ua_reference.attention(q, k, v, segment_ids=segment_ids, **kwargs)


_TABLES = {}


def leaky_cache_attention(q, k, v, **kwargs):
  """The reference with q times a per-length table of ones built on first use
  and cached: built inside a trace, the table is a tracer, which the next
  compile of that length takes as an input it is never given."""
  t = q.shape[1]
  if t not in _TABLES:
    _TABLES[t] = jnp.ones((t,), jnp.float32) + 0.0
  return ua_reference.attention(q * _TABLES[t].astype(q.dtype)[None, :, None, None], k, v,
                                **kwargs)


_CALLS = {"count": 0}


def _call_parity():
  """0.0, 1.0, 0.0, ... on successive executions (a host callback): what a run-to-run
  difference looks like to the suite, without a GPU's atomics."""
  def parity():
    _CALLS["count"] += 1
    return np.float32(_CALLS["count"] % 2)
  return jax.pure_callback(parity, jax.ShapeDtypeStruct((), jnp.float32))


def reordered_sums_attention(q, k, v, **kwargs):
  """The reference with every other run's out moved by one float32 ulp: reruns
  differ as a reordered sum's would (ua_deterministic = False)."""
  result = ua_reference.attention(q, k, v, **kwargs)
  out = result[0] if isinstance(result, tuple) else result
  out = (out.astype(jnp.float32) * (1 + 2.0 ** -23 * _call_parity())).astype(out.dtype)
  return (out,) + tuple(result[1:]) if isinstance(result, tuple) else out


reordered_sums_attention.ua_deterministic = False


def racy_attention(q, k, v, **kwargs):
  """The reference whose every other run loses the first key's share of out (a
  race that drops one key tile's contribution); declared not deterministic."""
  result = ua_reference.attention(q, k, v, **kwargs)
  out = result[0] if isinstance(result, tuple) else result
  lost = _call_parity() * v[:, :1].astype(jnp.float32).mean()
  out = (out.astype(jnp.float32) - lost).astype(out.dtype)
  return (out,) + tuple(result[1:]) if isinstance(result, tuple) else out


racy_attention.ua_deterministic = False
