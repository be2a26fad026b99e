"""JAX's Pallas-TPU splash attention behind the contract
(``properties.peers.impls:splash_attention`` loads it; docs/PEERS.md, "Splash attention").

``attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, sinks=None,
causal=False, window_len=0, cap_method="none", cap_params=(), temperature=None, sm_scale=None,
z_loss_weight=0.0, return_lse=False, config=None)``; off-TPU it runs splash's
``interpret=True`` mode.

Mapping (jax/experimental/pallas/ops/tpu/splash_attention/):
  sm_scale        -> q * sm_scale in q's dtype (splash applies no scale)
  tanh cap (c,)   -> attn_logits_soft_cap=c: c * tanh(qk / c) on the scaled logits
  Tq != Tk        -> masks of shape (Tq, Tk), each side padded to a multiple of 128
  q_offset (int)  -> the masks' offset: query i at key i + offset (a traced one: refused)
  causal          -> CausalMask: j <= i + offset
  window w        -> LocalMask(window_size=(w - 1, 0 if causal else None)): j >= i + offset - (w - 1)
  segment_ids     -> SegmentIds(q=ids, kv=kv ids) per batch row (vmap over B); the ids are
                     ranked among both sides' (values in [0, Tq + Tk)), padding = Tq + Tk, so
                     no real query sees a padded key; outputs cropped
  sinks [Hq]      -> splash's sinks (its forward starts each row's max at the sink and
                     its sum at 1); d sinks computed here, lse's cotangent included (splash's
                     own omits it)
  GQA / MQA       -> native: q head h reads kv head h // (Hq / Hkv)
  return_lse      -> save_residuals=True (lse = m + log l, natural log, float32). splash's
                     custom VJP refuses save_residuals under AD, so this path has its own
                     custom_vjp: forward = splash forward kernel, backward = splash's dkv/dq
                     kernels (private functions) with di = <dout, out> - dlse. Calls with
                     Tq != Tk, offsets, the keys' ids or sinks take it too: a row that sees
                     no key, which splash leaves undefined (the mean of v), gets out 0 and
                     lse -inf (or the sink) there, and no part in the gradients.
Not expressible: temperature, z-loss (declared, raise NotImplementedError), caps other
than tanh.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
from ua_reference.contract import validate_call

BLOCK = 128
DTYPES = ("float32", "bfloat16", "float16")
_BLOCKS = sk.BlockSizes.get_default()  # 128 everywhere, separate dq and dkv kernels


def _interpret() -> bool:
  return jax.default_backend() != "tpu"


@functools.lru_cache(maxsize=64)
def _kernel(shape, heads, causal, window_len, offset, soft_cap, is_mqa, save_residuals,
            interpret):
  """The splash kernel object, cached. make_splash_mha turns its mask tables (MaskInfo)
  into jax arrays with jnp.array, which under a jit trace (jax 0.10.2) yields *tracers*:
  cached, they would leak into the next trace. ensure_compile_time_eval makes them
  concrete device arrays, which later traces close over as constants."""
  with jax.ensure_compile_time_eval():
    return _make_kernel(shape, heads, causal, window_len, offset, soft_cap, is_mqa,
                        save_residuals, interpret)


def _make_kernel(shape, heads, causal, window_len, offset, soft_cap, is_mqa, save_residuals,
                 interpret):
  """``shape``: (queries, keys), both padded; query i sits at key i + ``offset``."""
  if window_len:
    mask = sm.LocalMask(shape, window_size=(window_len - 1, 0 if causal else None),
                        offset=offset)
  elif causal:
    mask = sm.CausalMask(shape, offset=offset)
  else:
    mask = sm.FullMask(shape)
  make = sk.make_splash_mqa_single_device if is_mqa else sk.make_splash_mha_single_device
  return make(
      sm.MultiHeadMask([mask] * heads), block_sizes=_BLOCKS, save_residuals=save_residuals,
      attn_logits_soft_cap=soft_cap, interpret=interpret)


def _collapse(info):
  if info is None or info.partial_mask_blocks is None:
    return info
  blocks = info.partial_mask_blocks
  return info._replace(partial_mask_blocks=blocks.reshape(-1, *blocks.shape[-2:]))


# splash masks with a large finite value, not -inf: a row that sees no key ends with
# an lse near it (or -inf, where every block of the row was skipped).
_NO_KEY_LSE = 0.5 * float(sk.DEFAULT_MASK_VALUE)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_lse(static, q, k, v, seg, sinks):
  """(out [H,Tq,D], lse [H,Tq]) of one batch row (MQA: one kv head, k/v [Tk,D]);
  seg: SegmentIds or None; sinks [H] or None. static[-1] is the matmul precision
  the kernels are traced under (None: JAX's default), in the forward and, apart
  from it, the backward. A row that sees no key (splash leaves it undefined,
  the mean of v) gets the contract's out 0 and lse -inf, or the sink's."""
  return _forward(static, q, k, v, seg, sinks)[:2]


def _forward(static, q, k, v, seg, sinks):
  with _precision(static[-1]):
    out, (lse,) = _kernel(*static[:-1], True, _interpret())(q, k, v, segment_ids=seg,
                                                            sinks=sinks)
  has_key = lse > _NO_KEY_LSE
  no_key = -jnp.inf if sinks is None else sinks[:, None].astype(lse.dtype)
  return jnp.where(has_key[..., None], out, 0), jnp.where(has_key, lse, no_key), has_key


def _precision(precision):
  return contextlib.nullcontext() if precision is None else \
      jax.default_matmul_precision(precision)


def _with_lse_fwd(static, q, k, v, seg, sinks):
  out, lse, has_key = _forward(static, q, k, v, seg, sinks)
  return (out, lse), (q, k, v, seg, sinks, out, lse, has_key)


def _with_lse_bwd(static, res, cts):
  with _precision(static[-1]):
    return _with_lse_bwd_kernels(static[:-1], res, cts)


def _with_lse_bwd_kernels(static, res, cts):
  q, k, v, seg, sinks, out, lse, has_key = res
  do, dlse = cts
  kern = _kernel(*static, False, _interpret())
  kw = kern.kwargs
  common = dict(is_mqa=kw["is_mqa"], mask_value=kw["mask_value"],
                attn_logits_soft_cap=kw["attn_logits_soft_cap"], q_layout=_BLOCKS.q_layout,
                k_layout=_BLOCKS.k_layout, v_layout=_BLOCKS.v_layout,
                mask_function=kw["mask_function"], interpret=kw["interpret"])
  # The contract's delta: <dout, out> - dlse (splash's own bwd has only the first term).
  di = jnp.einsum("hsd,hsd->hs", out.astype(jnp.float32), do.astype(jnp.float32))
  di = di - dlse.astype(jnp.float32)
  # Rows without a key take no part in dq, dk, dv: probabilities exp(s - lse) of 0.
  di_keys = jnp.where(has_key, di, 0.0)
  lse_keys = jnp.where(has_key, lse, jnp.finfo(jnp.float32).max)
  _, dk, dv = sk._splash_attention_bwd_dkv(
      q, k, v, seg, None, lse_keys, do, di_keys, bq=_BLOCKS.block_q_dkv,
      bkv=_BLOCKS.block_kv_dkv, bkv_compute=_BLOCKS.block_kv_dkv_compute,
      mask_info=_collapse(kern.dkv_mask_info), use_fused_bwd_kernel=False, **common)
  dq = sk._splash_attention_bwd_dq(
      q, k, v, seg, None, lse_keys, do, di_keys, bq=_BLOCKS.block_q_dq, bkv=_BLOCKS.block_kv_dq,
      mask_info=_collapse(kern.dq_mask_info), **common)
  seg_ct = None if seg is None else jax.tree.map(
      lambda x: jnp.zeros(x.shape, jax.dtypes.float0), seg)
  dsinks = None
  if sinks is not None:  # -sum of the sink's probability times delta, lse's term included
    s = sinks[:, None].astype(jnp.float32)
    p_sink = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(s - lse))
    dsinks = (-jnp.sum(p_sink * di, axis=1)).astype(sinks.dtype)
  return dq, dk, dv, seg_ct, dsinks


_with_lse.defvjp(_with_lse_fwd, _with_lse_bwd)


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, sinks=None,
              causal=False, window_len=0, cap_method="none", cap_params=(), temperature=None,
              sm_scale=None, z_loss_weight=0.0, return_lse=False, config=None, precision=None):
  """The contract through splash attention; ``config`` is accepted and ignored.
  ``precision`` (e.g. "highest"): the kernels' matmul precision, forward and
  backward, which JAX's context alone would not reach in the backward (traced
  when the VJP is called, outside the caller's context)."""
  del config
  call = validate_call(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      sinks=sinks, causal=causal, window_len=window_len, cap_method=cap_method,
      cap_params=cap_params, temperature=temperature, sm_scale=sm_scale,
      z_loss_weight=z_loss_weight, return_lse=return_lse)
  spec = call.spec
  _refuse(spec, q.dtype, call)
  soft_cap = spec.cap_params[0] if spec.cap_method == "tanh" else None
  b, t, hq, d = q.shape
  tk, hkv = k.shape[1], k.shape[2]
  tp, tkp = -(-t // BLOCK) * BLOCK, -(-tk // BLOCK) * BLOCK
  offset = spec.q_offset
  # A window reaching before key 0 for every query hides nothing.
  window = spec.window_len if spec.window_len <= t - 1 + offset else 0
  segs = _segment_ids(call.segment_ids, call.kv_segment_ids, b, t, tk, tp, tkp)

  def heads_first(x, length):  # [B,T,H,D] -> [B,H,Tp,D]
    return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0))), 1, 2)

  qs = heads_first((q * jnp.asarray(spec.sm_scale, q.dtype)).astype(q.dtype), tp)
  ks, vs = heads_first(k, tkp), heads_first(v, tkp)
  group = hq // hkv
  # GQA: splash's MHA kernel maps q head h to kv head lax.div(h, G) in its index maps,
  # which fails under jax_enable_x64 (int32 grid index / int64 divisor: "lax.div requires
  # arguments to have the same dtypes, got int32, int64"). So G > 1 runs splash's MQA
  # kernel on each kv head (q [G,T,D], k/v [T,D]), vmapped over the kv heads.
  mqa = group > 1
  static = ((tp, tkp), group if mqa else hq, spec.causal, window, offset, soft_cap, mqa)
  sinks = call.sinks
  # Offsets, the keys' ids and sinks can leave a row without keys, which splash's own
  # kernels leave undefined: _with_lse gives the contract's.
  if return_lse or precision is not None or tk != t or offset or \
      kv_segment_ids is not None or sinks is not None:
    with_lse = functools.partial(_with_lse, static + (precision,))
    row = with_lse if return_lse else lambda *a: with_lse(*a)[0]
  else:
    kern = _kernel(*static, False, _interpret())
    row = lambda q_, k_, v_, s_, _: kern(q_, k_, v_, segment_ids=s_)
  if mqa:
    per_kv = jax.vmap(row, in_axes=(0, 0, 0, None, 0))
    qs = qs.reshape(b, hkv, group, tp, d)
    sinks = None if sinks is None else sinks.reshape(hkv, group)
  res = jax.vmap(per_kv if mqa else row, in_axes=(0, 0, 0, 0, None))(qs, ks, vs, segs, sinks)
  if return_lse:
    out, lse = res
    out, lse = out.reshape(b, hq, tp, d), lse.reshape(b, hq, tp)
    return jnp.swapaxes(out, 1, 2)[:, :t], lse[..., :t].astype(jnp.float32)
  return jnp.swapaxes(res.reshape(b, hq, tp, d), 1, 2)[:, :t]


def _refuse(spec, dtype, call):
  """NotImplementedError for what splash cannot express (declared: docs/PEERS.md)."""
  if call.temperature is not None:
    raise NotImplementedError("splash attention has no per-query temperature")
  if spec.z_loss_weight:
    raise NotImplementedError("splash attention adapter: z-loss not supported")
  if spec.cap_method not in ("none", "tanh"):
    raise NotImplementedError(f"splash has only the tanh soft cap, not {spec.cap_method!r}")
  if jnp.dtype(dtype).name not in DTYPES:
    raise NotImplementedError(f"splash adapter: dtype {dtype} not supported")
  if spec.q_offset is None:
    raise NotImplementedError("splash's masks take a static offset, not a traced one")


def _segment_ids(seg, kv_seg, b, t, tk, tp, tkp):
  """splash's SegmentIds, padded to (tp, tkp), or None. The ids are ranked among
  the queries' and the keys' together (values in [0, t + tk)), so that the
  padding's id, t + tk, meets no real one: no real query sees a padded key,
  and a padded query sees the padded keys its position lets it (rows cropped;
  one that sees none, _with_lse leaves out of the backward)."""
  if seg is None and (tp, tkp) == (t, tk):
    return None
  if seg is None:
    seg, kv_seg = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, tk), jnp.int32)
  else:
    both = jnp.concatenate([seg, kv_seg], axis=1)
    ranks = jax.vmap(jnp.searchsorted)(jnp.sort(both, axis=1), both).astype(jnp.int32)
    seg, kv_seg = ranks[:, :t], ranks[:, t:]
  q_ids = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=t + tk)
  kv_ids = jnp.pad(kv_seg, ((0, 0), (0, tkp - tk)), constant_values=t + tk)
  return sk.SegmentIds(q=q_ids, kv=kv_ids)
