"""tokamax (Pallas Mosaic-GPU flash attention) behind the unified-attention contract.

Verify it with ``ua-verify --impl properties.peers.impls_tokamax:tokamax_attention`` on a
Hopper GPU with tokamax installed (docs/PEERS.md says how it was carried there).

``tokamax_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None,
causal=False, window_len=0, cap_method="none", cap_params=(), temperature=None,
sm_scale=None, z_loss_weight=0.0, return_lse=False, config=None, implementation="mosaic")``

Maps docs/SEMANTICS.md onto tokamax 0.0.17's Op API (the op behind
``tokamax.dot_product_attention(..., implementation="mosaic")``), calling the
Mosaic-GPU kernel explicitly (``tokamax.ops.gpu.PallasMosaicFlashAttention``)
because the functional API cannot return the softmax residuals.  Anything
tokamax cannot compute *exactly as the contract defines it* raises
NotImplementedError (docs/PEERS.md). File:line citations are into the tokamax 0.0.17 wheel.

Mapping (tokamax/_src/ops/attention/...):
  sm_scale          -> ``logits_scale`` (base.py:441-446; None -> 1/sqrt(D), same as ours)
  cap "tanh", (c,)  -> ``logits_soft_cap=c``: c*tanh(logits/c) after scaling (base.py:449-451)
  causal            -> ``Mask(is_causal=True)`` (standard causal fast path)
  window W, causal  -> ``CausalMask(offset=0, window_size=W)``: j <= i and j > i - W (base.py:63-65)
  window W, !causal -> ``Mask(k_start=max(0, i-W+1))``: j > i - W, future keys stay visible
  segment_ids       -> dense bool mask [B,1,T,T] (tokamax has no segment-id primitive);
                       T padded to a multiple of 64 (its mask VJP needs it, _same_length_mask)
  Tq != Tk, q_offset -> ``CausalMask(offset=q_offset, window_size=W)`` (traced offsets too)
                       or, not causal, ``k_start`` at the offset; with kv_segment_ids the
                       contract's whole mask, dense (_other_keys_mask); rows without a
                       visible key: out 0, lse -inf, as the contract says
  GQA               -> native: q head h reads kv head h // (Hq/Hkv) (base.py:426-431,
                       pallas_mosaic_gpu_kernel_sm90.py:554)
  return_lse        -> ``return_residuals=True`` gives (m, l) = (row max, sum exp(logit-m))
                       in natural units (sm90 kernel :514-528) -> lse = m + log(l),
                       [B, Hq, T] float32.  Forward only: tokamax's custom_vjp drops the
                       residuals' cotangent (ops/op.py:281,291), so a real cotangent on
                       lse raises NotImplementedError here instead of being silently lost.
Not expressible: temperature (applied after the cap; tokamax has only an additive
bias *before* the cap), z-loss (needs a gradient through lse), caps other than
tanh, float32 (the Mosaic kernel only runs bf16/f16 MMAs: f32 is either rejected
(default precision -> TF32 -> NotImplementedError, pallas_mosaic_gpu_common.py:
152-157) or silently downcast to bf16 with precision=BF16_BF16_F32).
"""

from __future__ import annotations

import functools
import sys
import types

import jax
import jax.numpy as jnp

from ua_reference import visible_keys
from ua_reference.contract import validate_call

__all__ = ["tokamax_attention", "tokamax_xla_attention", "h100_best_config",
           "install_xprof_stub"]


# --------------------------------------------------------------------------- import
def install_xprof_stub() -> None:
  """tokamax/__init__ imports tokamax._src.benchmarking, which does
  ``from xprof.cli.tools import get_kernel_stats_tool`` at module level
  (benchmarking.py:40).  The real xprof wheel is 32 MB and drags in
  google-cloud-storage, duckdb, ... ; it is only used for xprof-based timing,
  never by attention.  Register a stub if xprof is absent."""
  try:
    import xprof.cli.tools  # noqa: F401
    return
  except ImportError:
    pass
  pkg, cli, tools = (types.ModuleType(n) for n in ("xprof", "xprof.cli", "xprof.cli.tools"))
  pkg.__path__, cli.__path__ = [], []
  pkg.cli, cli.tools = cli, tools

  def get_kernel_stats_tool(*_a, **_k):
    raise RuntimeError("xprof is not installed (stub from "
                       "properties.peers.impls_tokamax.install_xprof_stub)")

  tools.get_kernel_stats_tool = get_kernel_stats_tool
  sys.modules.update({"xprof": pkg, "xprof.cli": cli, "xprof.cli.tools": tools})


@functools.cache
def _tk():
  """Lazily imports the tokamax pieces (so importing this module needs no tokamax)."""
  install_xprof_stub()
  from tokamax._src.ops.attention import base
  from tokamax._src.ops.attention import pallas_mosaic_gpu as mgpu
  from tokamax._src.ops.attention import pallas_mosaic_gpu_kernel_sm90 as sm90
  from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp as mgpu_vjp
  from tokamax._src.ops.attention import pallas_mosaic_gpu_vjp_common as vjp_common
  return types.SimpleNamespace(base=base, mgpu=mgpu, sm90=sm90, mgpu_vjp=mgpu_vjp,
                               vjp_common=vjp_common)


def h100_best_config(causal: bool):
  """(forward Config, VJP Config) that tokamax's own H100 autotuning cache
  (tokamax/data/autotuning/nvidia_h100_80gb_hbm3/pallas_mosaic_gpu_flash_attention*.json)
  records as fastest for bf16/f16, D=128, T=512..16384 (e.g. [4,4096,16,128]:
  fwd 0.843 ms full / 0.484 ms causal, VJP 2.847 / 1.686 ms).  The cache is keyed
  by device kind, so on an "NVIDIA H200" it is NOT consulted and tokamax falls back
  to heuristics (fwd: block_q=64, block_kv=128, num_stages=2, persistent=not causal;
  VJP: all blocks 64, num_stages=2).  Valid for D <= 128 (SMEM); for larger D use None."""
  tk = _tk()
  fwd = tk.sm90.Config(block_q=64, block_kv=128, num_stages=2, persistent=False)
  bwd = tk.vjp_common.Config(block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                             block_kv_dq=64, num_stages=2 if causal else 3, compute_wgs=2)
  return fwd, bwd


@functools.cache
def _op(dtype_name: str, fwd_config, vjp_config, implementation: str = "mosaic"):
  tk = _tk()
  if implementation == "xla":  # tokamax's own XLA op, the reference of its Op API
    return tk.base.DotProductAttention()
  vjp = tk.mgpu_vjp.PallasMosaicGpuFlashAttentionVjp(config=vjp_config)
  # The sm90 kernel skips the running max when a soft cap <= 60 is given
  # (base.needs_stable_softmax, base.py:753-768; sm90 kernel :444-458) and casts
  # p = exp(logit) (up to e^60) to the *value* dtype before the PV matmul: fine for
  # bf16, but it overflows float16 (max 65504) once c > ~11.  Force the stable
  # softmax for float16 so the result is exact for every cap.
  stable = True if dtype_name == "float16" else tk.base.AUTO
  return tk.mgpu.PallasMosaicGpuFlashAttention(config=fwd_config, vjp=vjp,
                                               use_stable_softmax=stable)


# Sequence multiple for the dense (segment-id) mask; see _attention.
_MASK_SEQ_MULTIPLE = 64


# --------------------------------------------------------------------------- lse guard
@jax.custom_vjp
def _lse_without_gradient(lse):
  return lse


def _guard_fwd(lse):
  return lse.value, None


def _guard_bwd(_, g):
  if isinstance(g, jax.custom_derivatives.SymbolicZero):
    return (None,)
  raise NotImplementedError(
      "tokamax cannot differentiate through the log-sum-exp: its custom_vjp drops "
      "the residuals' cotangent (tokamax/_src/ops/op.py:281,291)")


_lse_without_gradient.defvjp(_guard_fwd, _guard_bwd, symbolic_zeros=True)


# --------------------------------------------------------------------------- validation
def _refuse(spec, temperature, dtype):
  """tokamax's soft cap (None or c), or NotImplementedError for what it cannot express."""
  if temperature is not None:
    raise NotImplementedError("tokamax has no per-query temperature after the cap "
                              "(only an additive bias before it)")
  if spec.z_loss_weight:
    raise NotImplementedError("tokamax cannot carry a z-loss gradient (no gradient "
                              "through its softmax residuals)")
  if spec.cap_method not in ("none", "tanh"):
    raise NotImplementedError(f"tokamax has only the tanh soft cap, not {spec.cap_method!r}")
  if jnp.dtype(dtype).name not in ("bfloat16", "float16"):
    raise NotImplementedError(f"the tokamax adapter runs bf16/f16 only, not "
                              f"{jnp.dtype(dtype).name} (its Mosaic-GPU kernel would downcast "
                              f"f32 to bf16)")
  return float(spec.cap_params[0]) if spec.cap_method == "tanh" else None


def _pad_rows(x, length):
  return jnp.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))


def _same_length_mask(tk, t, causal, window_len, segment_ids):
  """(mask, padded length) of queries and keys of one length, no offset."""
  tp = t
  if segment_ids is not None and t % _MASK_SEQ_MULTIPLE:
    # The sm90 VJP kernel cannot TMA-load a dense [T,T] mask unless T is < 64 and a
    # multiple of 16, or a multiple of 64 (lowering raises "async_copy requires all
    # GMEM strides ... multiple of 16 bytes" / "... multiple of its tiling 64";
    # pallas_mosaic_gpu_vjp_kernel_sm90.py:212-217 pads the mask only to 8, then
    # TMA-tiles it at :442 and :666).  Pad the sequence;
    # padded keys are hidden from real queries, each padded query sees only its own
    # (zero) key, so real rows, their lse and all real gradients are unchanged.
    tp = -(-t // _MASK_SEQ_MULTIPLE) * _MASK_SEQ_MULTIPLE
  mask = tk.base.Mask(is_causal=bool(causal))
  if window_len and window_len < t:  # a window >= T hides nothing
    if causal:
      mask = tk.base.Mask(causal_mask=tk.base.CausalMask(offset=0, window_size=int(window_len)))
    else:
      k_start = jnp.maximum(jnp.arange(tp, dtype=jnp.int32) - (int(window_len) - 1), 0)
      mask = mask & tk.base.Mask(k_start=k_start)  # k_start: [T] = "#T"
  if segment_ids is not None:
    seg = jnp.pad(segment_ids, ((0, 0), (0, tp - t)))
    same = seg[:, None, :, None] == seg[:, None, None, :]  # [B,1,T,T]
    if tp != t:
      idx = jnp.arange(tp)
      real = idx < t
      same = jnp.where(real[:, None] & real[None, :], same,
                       (idx[:, None] == idx[None, :]) & ~real[:, None])
    mask = mask & tk.base.Mask(same)
  return mask, tp


def _other_keys_mask(tk, call, tq, tkv):
  """(mask, has_key [B or 1, Tq], padded lengths) of keys of another length, an
  offset or the keys' own ids. Without ids: tokamax's CausalMask at the offset
  (k <= q + offset, and k > q + offset - window; base.py:60-90, a traced offset
  taken) or, not causal, a window as k_start; with ids, the contract's whole mask
  (ua_reference.visible_keys), dense, both lengths padded to the VJP's multiple of
  64 (_same_length_mask): padded keys hidden from real queries, padded queries
  seeing every key (their cotangents are 0). has_key: the rows that see a key."""
  spec, offset, window = call.spec, call.q_offset, call.spec.window_len
  if call.segment_ids is not None:
    dense = visible_keys(tq, call.segment_ids, spec.causal, window, kv_seq_len=tkv,
                         kv_segment_ids=call.kv_segment_ids, q_offset=offset)  # [B,Tq,Tk]
    has_key = jnp.any(dense, axis=-1)
    tqp, tkp = (-(-n // _MASK_SEQ_MULTIPLE) * _MASK_SEQ_MULTIPLE for n in (tq, tkv))
    dense = jnp.pad(dense, ((0, 0), (0, tqp - tq), (0, tkp - tkv)))
    dense = dense | (jnp.arange(tqp) >= tq)[None, :, None]
    return tk.base.Mask(dense[:, None]), has_key, (tqp, tkp)
  pos = jnp.arange(tq, dtype=jnp.int32) + offset  # each query's key position
  lo = jnp.maximum(pos - window + 1, 0) if window else jnp.zeros_like(pos)
  hi = jnp.minimum(pos, tkv - 1) if spec.causal else jnp.full_like(pos, tkv - 1)
  if spec.causal:
    mask = tk.base.Mask(causal_mask=tk.base.CausalMask(offset=offset,
                                                       window_size=window or None))
  elif window:
    mask = tk.base.Mask(k_start=lo)
  else:
    mask = tk.base.Mask()
  # Every key past Tk hidden: the forward clamps its k_end to Tk (pallas_mosaic_gpu.py:
  # 148-152), the sm90 backward does not, and a row without keys (m -inf, l 0) would meet
  # the zero-filled keys of the last tile unmasked (p inf, ds NaN).
  mask = mask & tk.base.Mask(k_end=jnp.full((tq,), tkv, jnp.int32))
  return mask, (lo <= hi)[None], (tq, tkv)


def _config(config, causal, d):
  if config is None:
    return None, None
  if isinstance(config, str) and config == "h100_best":
    return h100_best_config(bool(causal)) if d <= 128 else (None, None)
  return config


# --------------------------------------------------------------------------- the adapter
def tokamax_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None,
                      causal=False, window_len=0, cap_method="none", cap_params=(),
                      temperature=None, sm_scale=None, z_loss_weight=0.0, return_lse=False,
                      config=None, implementation="mosaic"):
  """The contract through tokamax's Mosaic-GPU flash attention (sm90 on H100/H200),
  or with ``implementation="xla"`` tokamax's XLA op (``base.DotProductAttention``,
  configs ignored): tokamax_xla_attention.

  ``config``: None (tokamax's own choice: autotuning cache, else heuristics),
  "h100_best" (``h100_best_config(causal)``), or a ``(fwd_config, vjp_config)``
  pair (tokamax sm90.Config / vjp_common.Config; either may be None).
  Keys of another length, an offset or the keys' own ids: _other_keys_mask; a
  row that sees no key gets the contract's out 0 and lse -inf.
  """
  call = validate_call(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      causal=causal, window_len=window_len, cap_method=cap_method, cap_params=cap_params,
      temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss_weight,
      return_lse=return_lse)
  spec = call.spec
  soft_cap = _refuse(spec, call.temperature, q.dtype)
  if implementation not in ("mosaic", "xla"):
    raise ValueError(f"implementation must be 'mosaic' or 'xla', got {implementation!r}")
  tk = _tk()
  _, t, _, d = q.shape
  tkv = k.shape[1]
  other_keys = tkv != t or q_offset is not None or kv_segment_ids is not None
  if other_keys:
    mask, has_key, (tqp, tkp) = _other_keys_mask(tk, call, t, tkv)
    q, k, v = _pad_rows(q, tqp), _pad_rows(k, tkp), _pad_rows(v, tkp)
  else:
    mask, tp = _same_length_mask(tk, t, spec.causal, spec.window_len, call.segment_ids)
    q, k, v = _pad_rows(q, tp), _pad_rows(k, tp), _pad_rows(v, tp)
  op = _op(jnp.dtype(q.dtype).name, *_config(config, causal, d), implementation)
  out, residuals = op(q, k, v, logits_scale=float(spec.sm_scale), logits_soft_cap=soft_cap,
                      mask=mask, return_residuals=True)
  out = out[:, :t].astype(q.dtype)
  m, l = residuals  # [B, Hq, T] float32 each, natural-log units
  lse = (m + jnp.log(l))[..., :t].astype(jnp.float32)
  if other_keys:
    out = jnp.where(has_key[:, :, None, None], out, 0)
    lse = jnp.where(has_key[:, None, :], lse, -jnp.inf)
  if not return_lse:
    return out
  return out, _lse_without_gradient(lse)


# Capability declarations (properties/model/capabilities.py).
tokamax_attention.ua_unsupported = {"temperature", "z_loss", "lse"}
tokamax_attention.ua_cap_methods = ("tanh",)
tokamax_attention.ua_dtypes = ("bfloat16", "float16")
# Forward pads D to a multiple of 16 (bf16/f16) and the VJP to a multiple of 64;
# tokamax's tests use 24/48/64 and its H100 autotuning cache holds fwd+VJP for
# D = 16, 32, 64, 128, 192 (q/k; v 128) and 256.  Larger D exceeds SMEM.
tokamax_attention.ua_head_dims = lambda d: d % 8 == 0 and 8 <= d <= 256
# Forward: each CTA runs 2 compute warpgroups of block_q=64 rows -> 128-row q tiles;
# kv tiles 128 (64 when SMEM is tight).  VJP: 64-row/col blocks, 128-wide per CTA.
tokamax_attention.ua_block_sizes = (64, 128)


def tokamax_xla_attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None,
                          causal=False, window_len=0, cap_method="none", cap_params=(),
                          temperature=None, sm_scale=None, z_loss_weight=0.0, return_lse=False):
  """tokamax_attention on tokamax's XLA op: the same mapping of the contract onto
  tokamax's masks, on any backend; bfloat16 only (XLA:CPU has no F16_F16_F32
  dot for float16). tests/test_tokamax_adapter.py runs it."""
  return tokamax_attention(q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                           q_offset=q_offset, causal=causal, window_len=window_len,
                           cap_method=cap_method, cap_params=cap_params,
                           temperature=temperature, sm_scale=sm_scale,
                           z_loss_weight=z_loss_weight, return_lse=return_lse,
                           implementation="xla")


for _name in ("ua_unsupported", "ua_cap_methods", "ua_head_dims"):
  setattr(tokamax_xla_attention, _name, getattr(tokamax_attention, _name))
tokamax_xla_attention.ua_dtypes = ("bfloat16",)  # its float16 product does not run on a CPU
