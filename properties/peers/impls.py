"""Adapters: other attention implementations behind the contract's signature,
each declaring what it supports (docs/PEERS.md says why, peer by peer).

Verify one with ``ua-verify --impl properties.peers.impls:<name>``. They import their
peer lazily, so the suite imports nothing of them until asked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NO_CONTRACT_EXTRAS = {"segment_ids", "cap", "temperature", "z_loss", "lse"}


def _jax_nn(implementation):
  def attention(q, k, v, *, segment_ids=None, causal=False, window_len=0, cap_method="none",
                cap_params=(), temperature=None, sm_scale=None, z_loss_weight=0.0,
                return_lse=False, q_offset=None):
    if (segment_ids is not None or cap_method != "none" or temperature is not None
        or z_loss_weight or return_lse):
      raise NotImplementedError(f"jax.nn.dot_product_attention[{implementation}] declares "
                                "these unsupported")
    tq, tk = q.shape[1], k.shape[1]
    dtype = q.dtype
    if (implementation == "xla" and dtype in (jnp.float16, jnp.bfloat16)
        and jax.default_backend() == "cpu"):
      # XLA:CPU has no 16-bit x 16-bit -> float32 dot algorithm for this op.
      q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    if q_offset is None and tq == tk:
      # Contract window: key j visible iff j > i - window_len (left side only).
      local = (window_len - 1, tq) if window_len > 0 else None
      out = jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=causal,
                                         local_window_size=local,
                                         implementation=implementation)
    else:
      out = _jax_nn_offset(implementation, q, k, v, sm_scale, causal, window_len, q_offset)
    return out.astype(dtype)
  return attention


def _jax_nn_offset(implementation, q, k, v, sm_scale, causal, window_len, q_offset):
  """Queries at key positions i + q_offset (default Tk - Tq): jax.nn's own
  causal and local masks align the first query with the first key, so the
  contract's mask is passed as ``mask``. A row whose mask hides every key gets
  the mean of v from jax.nn (its masked logits are a large finite negative);
  the contract's row without keys is 0, which the adapter returns there."""
  from ua_reference import visible_keys
  tq, tk = q.shape[1], k.shape[1]
  mask = visible_keys(tq, None, causal, window_len, kv_seq_len=tk,
                      q_offset=tk - tq if q_offset is None else q_offset)[0]
  out = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], scale=sm_scale,
                                     implementation=implementation)
  return jnp.where(jnp.any(mask, axis=1)[None, :, None, None], out, 0.0)


jax_nn_attention = _jax_nn("xla")
jax_nn_attention.__doc__ = """``jax.nn.dot_product_attention`` (XLA).

It has no segment ids, caps, temperature, z-loss or sinks; its lse
(``return_residual``) is rounded to the input dtype and carries no gradient, so
``lse`` is a contract difference too. Queries and keys of other lengths and
offsets: the contract's mask, passed as ``mask`` (_jax_nn_offset)."""
jax_nn_attention.ua_unsupported = _NO_CONTRACT_EXTRAS | {"kv_segment_ids", "sinks"}

jax_nn_cudnn = _jax_nn("cudnn")
jax_nn_cudnn.__doc__ = """``jax.nn.dot_product_attention`` through cuDNN (GPU only).

As the XLA path, and: cuDNN takes a window only together with causal (jax raises
"cuDNN doesn't support right window" otherwise), which the declarations cannot
say, so windows are declared unsupported; 16-bit inputs; head dims multiples
of 8 up to 128 (cuDNN's flash attention)."""
# Queries and keys of other lengths and offsets go through a dense mask on the XLA path
# only: cuDNN's is not run here (docs/PEERS.md).
jax_nn_cudnn.ua_unsupported = _NO_CONTRACT_EXTRAS | {"window", "kv_length", "q_offset",
                                                     "kv_segment_ids", "sinks"}
jax_nn_cudnn.ua_dtypes = ("bfloat16", "float16")
jax_nn_cudnn.ua_head_dims = lambda d: d % 8 == 0 and d <= 128


# JAX's Pallas-Triton flash attention at its best-known tiles on the H200
# (docs/BENCHMARKS.md: block_q 128, block_k 64, all backward blocks 64).
PALLAS_MHA_TILES = dict(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64,
                        block_q_dq=64, block_kv_dq=64)
_PAD = 128  # mha needs T to be a multiple of its tiles (and a power of two below them)


def pallas_triton_mha(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                      cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                      z_loss_weight=0.0, return_lse=False):
  """``jax.experimental.pallas.ops.gpu.attention.mha`` (Pallas-Triton, GPU only) at
  PALLAS_MHA_TILES.

  It takes segment ids with the contract's same-segment rule, and causal masks.
  The adapter pads T to a multiple of 128 (mha needs whole tiles), giving the
  padding a segment id of its own so that no real query sees it. mha has no GQA
  (K/V must have Hq heads), window, cap, temperature or z-loss; its lse
  (``return_residuals``) is base 2 and cannot be differentiated; float32 runs in
  TF32 unless a global matmul precision says otherwise: those are declared
  unsupported (docs/PEERS.md)."""
  if (window_len or cap_method != "none" or temperature is not None or z_loss_weight
      or return_lse or k.shape[2] != q.shape[2]):
    raise NotImplementedError("pallas_triton_mha declares these unsupported")
  from jax.experimental.pallas.ops.gpu import attention as pallas_attention
  b, t, _, d = q.shape
  padded = -(-t // _PAD) * _PAD
  seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  if padded != t:
    pad_id = jnp.max(seg) + 1
    seg = jnp.concatenate([seg, jnp.broadcast_to(pad_id, (b, padded - t))], axis=1)
    q, k, v = (jnp.pad(x, ((0, 0), (0, padded - t), (0, 0), (0, 0))) for x in (q, k, v))
  out = pallas_attention.mha(
      q, k, v, segment_ids=seg if (segment_ids is not None or padded != t) else None,
      sm_scale=d ** -0.5 if sm_scale is None else sm_scale, causal=causal,
      block_sizes=pallas_attention.BlockSizes(**PALLAS_MHA_TILES),
      interpret=jax.default_backend() != "gpu")
  return out[:, :t]


pallas_triton_mha.ua_unsupported = {"window", "cap", "temperature", "z_loss", "lse", "gqa"}
pallas_triton_mha.ua_dtypes = ("bfloat16", "float16")
pallas_triton_mha.ua_block_sizes = (64, 128)


def splash_attention(q, k, v, *, kv_segment_ids=None, q_offset=None, sinks=None, **kwargs):
  """JAX's Pallas-TPU splash attention (``jax.experimental.pallas.ops.tpu.
  splash_attention``) behind the contract: on a TPU its compiled kernels, else
  its interpret mode (properties/peers/impls_splash.py holds the mapping). Its
  signature names the keywords of Tq != Tk, offsets, the keys' ids and sinks,
  which the suite draws only for a callable that names them (docs/PLUGINS.md)."""
  from .impls_splash import attention
  return attention(q, k, v, kv_segment_ids=kv_segment_ids, q_offset=q_offset, sinks=sinks,
                   **kwargs)


splash_attention.ua_unsupported = ("temperature", "z_loss")
splash_attention.ua_cap_methods = ("tanh",)  # attn_logits_soft_cap: c * tanh(x / c)
# float16 does not compile on a TPU v5e (Mosaic: "Invalid vector type for load"; docs/PEERS.md).
splash_attention.ua_dtypes = ("float32", "bfloat16")
splash_attention.ua_block_sizes = (128,)  # its default block sizes; T padded to them


def splash_attention_highest(q, k, v, *, kv_segment_ids=None, q_offset=None, sinks=None,
                             **kwargs):
  """splash attention with its kernels traced under
  ``jax.default_matmul_precision("highest")``, forward and backward, which
  Mosaic lowers to fp32 contract precision: at the default, its float32 products
  take one bfloat16 pass (docs/PEERS.md, "splash attention")."""
  from .impls_splash import attention
  return attention(q, k, v, kv_segment_ids=kv_segment_ids, q_offset=q_offset, sinks=sinks,
                   precision="highest", **kwargs)


for _name in ("ua_unsupported", "ua_cap_methods", "ua_block_sizes"):
  setattr(splash_attention_highest, _name, getattr(splash_attention, _name))
splash_attention_highest.ua_dtypes = ("float32",)  # bfloat16 products are exact at any precision
