"""tokamax (Pallas Mosaic-GPU flash attention) behind the unified-attention contract.

Verify it with ``ua-verify --impl properties.peers.impls_tokamax:tokamax_attention`` on a
Hopper GPU with tokamax installed (docs/PEERS.md says how it was carried there).

``tokamax_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
cap_method="none", cap_params=(), temperature=None, sm_scale=None,
z_loss_weight=0.0, return_lse=False, config=None)``

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
                       T padded to a multiple of 64 (its mask VJP needs it, see _attention)
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

from ua_reference.contract import validate

__all__ = ["tokamax_attention", "h100_best_config", "install_xprof_stub"]


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
def _op(dtype_name: str, fwd_config, vjp_config):
  tk = _tk()
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
def _validate(q, k, v, **kw):
  spec, segment_ids, temperature = validate(q, k, v, **kw)
  return spec.sm_scale, segment_ids, temperature


# --------------------------------------------------------------------------- the adapter
def tokamax_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                      cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                      z_loss_weight=0.0, return_lse=False, config=None):
  """The contract through tokamax's Mosaic-GPU flash attention (sm90 on H100/H200).

  ``config``: None (tokamax's own choice: autotuning cache, else heuristics),
  "h100_best" (``h100_best_config(causal)``), or a ``(fwd_config, vjp_config)``
  pair (tokamax sm90.Config / vjp_common.Config; either may be None).
  """
  sm_scale, segment_ids, temperature = _validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, z_loss_weight=z_loss_weight, return_lse=return_lse)

  if temperature is not None:
    raise NotImplementedError("tokamax has no per-query temperature after the cap "
                              "(only an additive bias before it)")
  if z_loss_weight:
    raise NotImplementedError("tokamax cannot carry a z-loss gradient (no gradient "
                              "through its softmax residuals)")
  if cap_method == "none":
    soft_cap = None
  elif cap_method == "tanh":
    (soft_cap,) = (float(c) for c in cap_params)
  else:
    raise NotImplementedError(f"tokamax has only the tanh soft cap, not {cap_method!r}")
  dtype = jnp.dtype(q.dtype)
  if dtype.name not in ("bfloat16", "float16"):
    raise NotImplementedError(f"tokamax's Mosaic-GPU attention runs bf16/f16 only, not "
                              f"{dtype.name} (f32 would be downcast to bf16)")

  tk = _tk()
  b, t, hq, d = q.shape
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
    pad = lambda x: jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, 0)))
    q, k, v = pad(q), pad(k), pad(v)
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

  if config is None:
    fwd_cfg = vjp_cfg = None
  elif isinstance(config, str) and config == "h100_best":
    fwd_cfg, vjp_cfg = h100_best_config(bool(causal)) if d <= 128 else (None, None)
  else:
    fwd_cfg, vjp_cfg = config
  op = _op(dtype.name, fwd_cfg, vjp_cfg)

  out, residuals = op(q, k, v, logits_scale=float(sm_scale), logits_soft_cap=soft_cap,
                      mask=mask, return_residuals=True)
  out = out[:, :t].astype(q.dtype)
  if not return_lse:
    return out
  m, l = residuals  # [B, Hq, T] float32 each, natural-log units
  lse = (m + jnp.log(l))[..., :t]
  return out, _lse_without_gradient(lse.astype(jnp.float32))


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
