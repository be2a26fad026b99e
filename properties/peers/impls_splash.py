"""JAX's Pallas-TPU splash attention behind the contract
(``properties.peers.impls:splash_attention`` loads it; docs/PEERS.md, "Splash attention").

``attention(q, k, v, *, segment_ids=None, causal=False, window_len=0, cap_method="none",
cap_params=(), temperature=None, sm_scale=None, z_loss_weight=0.0, return_lse=False,
config=None)``; off-TPU it runs splash's ``interpret=True`` mode.

Mapping (jax/experimental/pallas/ops/tpu/splash_attention/):
  sm_scale        -> q * sm_scale in q's dtype (splash applies no scale)
  tanh cap (c,)   -> attn_logits_soft_cap=c: c * tanh(qk / c) on the scaled logits
  causal          -> CausalMask: j <= i
  window w        -> LocalMask(window_size=(w - 1, 0 if causal else None)): j >= i - (w - 1)
  segment_ids     -> SegmentIds(q=ids, kv=ids) per batch row (vmap over B)
  GQA / MQA       -> native: q head h reads kv head h // (Hq / Hkv)
  T % 128 != 0    -> T padded to a multiple of 128; the padding gets a segment id of its
                     own (ids are rank-mapped to [0, T), padding = T), so no real query
                     sees a padded key and every padded query sees itself; outputs cropped.
  return_lse      -> save_residuals=True (lse = m + log l, natural log, float32). splash's
                     custom VJP refuses save_residuals under AD, so this path has its own
                     custom_vjp: forward = splash forward kernel, backward = splash's dkv/dq
                     kernels (private functions) with di = <dout, out> - dlse.
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
from ua_reference.contract import validate

BLOCK = 128
DTYPES = ("float32", "bfloat16", "float16")
_BLOCKS = sk.BlockSizes.get_default()  # 128 everywhere, separate dq and dkv kernels


def _interpret() -> bool:
  return jax.default_backend() != "tpu"


@functools.lru_cache(maxsize=64)
def _kernel(tp, heads, causal, window_len, soft_cap, is_mqa, save_residuals, interpret):
  """The splash kernel object, cached. make_splash_mha turns its mask tables (MaskInfo)
  into jax arrays with jnp.array, which under a jit trace (jax 0.10.2) yields *tracers*:
  cached, they would leak into the next trace. ensure_compile_time_eval makes them
  concrete device arrays, which later traces close over as constants."""
  with jax.ensure_compile_time_eval():
    return _make_kernel(tp, heads, causal, window_len, soft_cap, is_mqa, save_residuals,
                        interpret)


def _make_kernel(tp, heads, causal, window_len, soft_cap, is_mqa, save_residuals, interpret):
  shape = (tp, tp)
  if window_len:
    mask = sm.LocalMask(shape, window_size=(window_len - 1, 0 if causal else None), offset=0)
  elif causal:
    mask = sm.CausalMask(shape)
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _with_lse(static, q, k, v, seg):
  """(out [H,T,D], lse [H,T]) of one batch row (MQA: one kv head, k/v [T,D]);
  seg: SegmentIds or None. static[-1] is the matmul precision the kernels are
  traced under (None: JAX's default), in the forward and, apart from it, the backward."""
  with _precision(static[-1]):
    out, (lse,) = _kernel(*static[:-1], True, _interpret())(q, k, v, segment_ids=seg)
  return out, lse


def _precision(precision):
  return contextlib.nullcontext() if precision is None else \
      jax.default_matmul_precision(precision)


def _with_lse_fwd(static, q, k, v, seg):
  out, lse = _with_lse(static, q, k, v, seg)
  return (out, lse), (q, k, v, seg, out, lse)


def _with_lse_bwd(static, res, cts):
  with _precision(static[-1]):
    return _with_lse_bwd_kernels(static[:-1], res, cts)


def _with_lse_bwd_kernels(static, res, cts):
  q, k, v, seg, out, lse = res
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
  _, dk, dv = sk._splash_attention_bwd_dkv(
      q, k, v, seg, None, lse, do, di, bq=_BLOCKS.block_q_dkv, bkv=_BLOCKS.block_kv_dkv,
      bkv_compute=_BLOCKS.block_kv_dkv_compute, mask_info=_collapse(kern.dkv_mask_info),
      use_fused_bwd_kernel=False, **common)
  dq = sk._splash_attention_bwd_dq(
      q, k, v, seg, None, lse, do, di, bq=_BLOCKS.block_q_dq, bkv=_BLOCKS.block_kv_dq,
      mask_info=_collapse(kern.dq_mask_info), **common)
  seg_ct = None if seg is None else jax.tree.map(
      lambda x: jnp.zeros(x.shape, jax.dtypes.float0), seg)
  return dq, dk, dv, seg_ct


_with_lse.defvjp(_with_lse_fwd, _with_lse_bwd)


def attention(q, k, v, *, segment_ids=None, causal=False, window_len=0, cap_method="none",
              cap_params=(), temperature=None, sm_scale=None, z_loss_weight=0.0,
              return_lse=False, config=None, precision=None):
  """The contract through splash attention; ``config`` is accepted and ignored.
  ``precision`` (e.g. "highest"): the kernels' matmul precision, forward and
  backward, which JAX's context alone would not reach in the backward (traced
  when the VJP is called, outside the caller's context)."""
  del config
  spec, seg, temperature = validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, z_loss_weight=z_loss_weight, return_lse=return_lse)
  if temperature is not None:
    raise NotImplementedError("splash attention has no per-query temperature")
  if spec.z_loss_weight:
    raise NotImplementedError("splash attention adapter: z-loss not supported")
  if spec.cap_method not in ("none", "tanh"):
    raise NotImplementedError(f"splash has only the tanh soft cap, not {spec.cap_method!r}")
  if jnp.dtype(q.dtype).name not in DTYPES:
    raise NotImplementedError(f"splash adapter: dtype {q.dtype} not supported")
  soft_cap = spec.cap_params[0] if spec.cap_method == "tanh" else None
  b, t, hq, d = q.shape
  tp = -(-t // BLOCK) * BLOCK
  window = spec.window_len if spec.window_len < t else 0  # a window of T hides nothing

  if seg is not None and tp != t:  # ranks in [0, T): T is free for the padding
    seg = jax.vmap(jnp.searchsorted)(jnp.sort(seg, axis=1), seg).astype(jnp.int32)
  elif seg is None and tp != t:
    seg = jnp.zeros((b, t), jnp.int32)
  if seg is not None:
    seg = jnp.pad(seg, ((0, 0), (0, tp - t)), constant_values=t)

  def heads_first(x):  # [B,T,H,D] -> [B,H,Tp,D]
    return jnp.swapaxes(jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0))), 1, 2)

  qs = heads_first((q * jnp.asarray(spec.sm_scale, q.dtype)).astype(q.dtype))
  ks, vs = heads_first(k), heads_first(v)
  segs = None if seg is None else sk.SegmentIds(q=seg, kv=seg)
  hkv = k.shape[2]
  group = hq // hkv
  # GQA: splash's MHA kernel maps q head h to kv head lax.div(h, G) in its index maps,
  # which fails under jax_enable_x64 (int32 grid index / int64 divisor: "lax.div requires
  # arguments to have the same dtypes, got int32, int64"). So G > 1 runs splash's MQA
  # kernel on each kv head (q [G,T,D], k/v [T,D]), vmapped over the kv heads.
  mqa = group > 1
  static = (tp, group if mqa else hq, spec.causal, window, soft_cap, mqa)
  if return_lse or precision is not None:
    with_lse = functools.partial(_with_lse, static + (precision,))
    row = with_lse if return_lse else lambda *a: with_lse(*a)[0]
  else:
    kern = _kernel(*static, False, _interpret())
    row = lambda q_, k_, v_, s_: kern(q_, k_, v_, segment_ids=s_)
  if mqa:
    per_kv = jax.vmap(row, in_axes=(0, 0, 0, None))
    qs = qs.reshape(b, hkv, group, tp, d)
  res = jax.vmap(per_kv if mqa else row)(qs, ks, vs, segs)
  if return_lse:
    out, lse = res
    out, lse = out.reshape(b, hq, tp, d), lse.reshape(b, hq, tp)
    return jnp.swapaxes(out, 1, 2)[:, :t], lse[..., :t].astype(jnp.float32)
  return jnp.swapaxes(res.reshape(b, hq, tp, d), 1, 2)[:, :t]
