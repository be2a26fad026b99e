"""Public op: validation, padding, the three pallas_calls, and the custom VJP.

The forward saves only O(T) residuals besides the inputs (out and each row's
softmax statistics, SoftmaxState.finalize's shift and, for float32, low); the
backward folds the lse cotangent and the z-loss into delta, so the dq and dk/dv
kernels need no extra inputs for them:
  d logits = p * (dp - delta),  delta = rowsum(dO * O) - dlse - w * lse.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ua_reference.contract import StaticSpec, validate

from . import cap_forms, fast_math, kernels, mosaic_backward, mosaic_forward
from .kernel_config import KernelConfig
from .padding import pad as _pad
from .segment_spans import segment_ranges
from .tile_math import LN2, exp2_scale
from .tuned_configs import effective_config

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _next_pow2(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _layout(spec: StaticSpec, config: KernelConfig):
  """Padded head dim, padded length, and the blocks clipped to the length."""
  head_dim = max(16, _next_pow2(spec.head_dim))
  longest_block = max(16, _next_pow2(spec.seq_len))
  blocks = {name: min(getattr(config, name), longest_block) for name in (
      "block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
      "block_kv_dkv")}
  biggest = max(blocks.values())
  seq_pad = -(-spec.seq_len // biggest) * biggest
  return head_dim, seq_pad, blocks


# Largest cap parameter evaluated with a fast form (_fast_cap).
FAST_CAP_MAX_PARAM = 64.0


def _fast_cap(spec: StaticSpec, dtype) -> bool:
  """bfloat16 inputs take the caps' fast forms (cap_forms) for caps up to
  FAST_CAP_MAX_PARAM. bfloat16's unit roundoff, 2^-9, is four times the fast
  tanh's 2^-11; float16's equals it, and the suite measured the fast form out
  of float16's tolerance, so float16 keeps the exact forms. The fast tanh's
  error is relative to its value, so a capped logit c*tanh(x/c) is off by up
  to c * 2^-11: caps up to 64 keep it within 2^-5 of a logit, larger ones take
  the exact tanh (docs/DEFECTS.md, B16)."""
  return (jnp.dtype(dtype) == jnp.bfloat16
          and max(spec.cap_params, default=0.0) <= FAST_CAP_MAX_PARAM)


def _per_head_totals(spec: StaticSpec, dtype) -> bool:
  """Whether the dk/dv kernel sums each query head of a GQA group from zero
  before adding it to the group's total (kernels.dkv_kernel). float32 outputs
  need it: with one shared accumulator a long group's sum loses precision in
  proportion to its size (docs/DEFECTS.md, G1). 16-bit outputs round away what
  remains and keep the registers of a second pair of accumulators."""
  return spec.group_size > 1 and jnp.dtype(dtype) == jnp.float32


def _interpret(config: KernelConfig) -> bool:
  if config.interpret is not None:
    return config.interpret
  return jax.default_backend() != "gpu"


def _compiler_params(config: KernelConfig, backward: bool = False):
  warps = config.num_warps_bwd if backward else config.num_warps
  stages = config.num_stages_bwd if backward else config.num_stages
  return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def _pallas_call(config: KernelConfig, inputs, kernel, **kwargs):
  """pallas_call, interpreted or compiled as ``config`` says, with the kernel
  traced for the matching fast-math mode (ua_kernels.fast_math)."""
  interpret = _interpret(config)
  with fast_math.native(None if interpret else "triton"):
    return pl.pallas_call(kernel, interpret=interpret, **kwargs)(*inputs)


def _prepare(spec, config, q, k, v, seg, temp, kseg=None):
  """Pads to the kernel layout; segment ids gain their spans and runs
  ([B, 4, T_pad], segment_spans.segment_ranges), unless the keys have their
  own (``kseg``: the spans would be the queries'); temperature becomes
  [B, Hq, T_pad]."""
  head_dim, seq_pad, blocks = _layout(spec, config)
  q, k, v = (_pad(x, {1: seq_pad, 3: head_dim}) for x in (q, k, v))
  spans = None
  if seg is not None:
    spans = None if kseg is not None else segment_ranges(seg, seq_pad)
    seg = _pad(seg, {1: seq_pad})
  if temp is not None:
    temp = _pad(jnp.transpose(temp, (0, 2, 1)), {2: seq_pad})
  return q, k, v, seg, spans, temp, head_dim, seq_pad, blocks


def _segment_specs(seg, spans, seq_pad: int):
  """BlockSpecs of the whole row of segment ids and of their spans, for any of
  the three grids (tile, batch, head); None for each that is absent."""
  return (None if seg is None else pl.BlockSpec((None, seq_pad), lambda i, bi, h: (bi, 0)),
          None if spans is None else pl.BlockSpec((None, 4, seq_pad),
                                                  lambda i, bi, h: (bi, 0, 0)))


class KeyBlock(NamedTuple):
  """Keys from elsewhere in the sequence (a shard of context_parallel): their
  own segment ids [B, T] (or None) and ``offset``, an int32 scalar, how far
  the queries' positions lie after the keys' (kernels.forward_kernel)."""

  segment_ids: jax.Array | None
  offset: jax.Array


# The offset travels as a [1, 16] int32 row (Triton loads no scalars; kernels._offset).
_OFFSET_SPEC = pl.BlockSpec((1, 16), lambda i, bi, h: (0, 0))


def _key_block_inputs(keys: "KeyBlock | None", seq_pad: int):
  """(kseg, offset row) padded for the kernels, and their BlockSpecs."""
  if keys is None:
    return (None, None), (None, None)
  kseg = None if keys.segment_ids is None else _pad(keys.segment_ids, {1: seq_pad})
  offset = jnp.broadcast_to(jnp.asarray(keys.offset, jnp.int32), (1, 16))
  kseg_spec, _ = _segment_specs(kseg, None, seq_pad)  # the queries' ids' spec
  return (kseg, offset), (kseg_spec, _OFFSET_SPEC)


def _query_program_specs(spec: StaticSpec, bq: int, head_dim: int, seq_pad: int):
  """BlockSpecs of a program that owns one query tile (forward, dq) on the grid
  (query tile i, batch, query head): its [bq, D] tile, the whole K/V of its kv
  head, and its [bq] row vector."""
  group = spec.group_size
  tile = pl.BlockSpec((None, bq, None, head_dim), lambda i, bi, h: (bi, i, h, 0))
  whole_kv = pl.BlockSpec((None, seq_pad, None, head_dim),
                          lambda i, bi, h: (bi, 0, h // group, 0))
  row = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i))
  return tile, whole_kv, row


def _is_hopper() -> bool:
  """Whether the default device is an sm90 GPU (H100, H200): wgmma and the
  TMA engine as Mosaic's Hopper lowering uses them exist there only."""
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


def forward_backend(spec: StaticSpec, config: KernelConfig, dtype, keys=None) -> str:
  """"mosaic" or "triton": the kernels of the forward for this call and config
  (KernelConfig.backend). "auto" takes Mosaic on Hopper for 16-bit inputs and
  head dims up to 256; keys from elsewhere (a KeyBlock) only Triton takes."""
  if config.backend == "triton":
    return "triton"
  why = mosaic_forward.unsupported(spec, dtype)
  if keys is not None:
    why = "keys from another block of the sequence (context_parallel) run on Triton only"
  if config.backend == "mosaic":
    if why:
      raise ValueError(f"KernelConfig(backend='mosaic'): {why}")
    if config.interpret:
      raise ValueError("KernelConfig(backend='mosaic') cannot run in the Pallas interpreter "
                       "(interpret=True)")
    return "mosaic"
  if why is None and not _interpret(config) and _is_hopper():
    return "mosaic"
  return "triton"


def _keeps_low(dtype) -> bool:
  """Whether the forward's row statistics keep their low part, log2 of the row
  sum apart from the row max (SoftmaxState.finalize). float32 gradients need
  it where the logits are large (docs/DEFECTS.md, D32); 16-bit ones round far
  more than what one float32 loses, and the Mosaic kernels, 16-bit only, do
  without."""
  return jnp.dtype(dtype) == jnp.float32


def _lse2(spec: StaticSpec, temp, shift, low):
  """The base-2 lse [B, Hq, T] from the forward's row statistics (-inf on rows
  without a visible key)."""
  lse2 = shift * exp2_scale(spec, temp is not None)
  return lse2 if low is None else lse2 + low


def _forward(spec: StaticSpec, config: KernelConfig, q, k, v, seg, temp,
             keys: KeyBlock | None = None):
  """(out, shift, low): the rows' statistics of SoftmaxState.finalize, low
  None unless _keeps_low. ``config`` is effective (effective_config)."""
  config.require_filled("ua_kernels.attention's forward")
  if forward_backend(spec, config, q.dtype, keys) == "mosaic":
    return (*mosaic_forward.forward(spec, config.mosaic, q, k, v, seg, temp,
                                    fast_cap=_fast_cap(spec, q.dtype)), None)
  keep_low = _keeps_low(q.dtype)
  b, t, hq, d = q.shape
  q, k, v, seg, spans, temp, head_dim, seq_pad, blocks = _prepare(
      spec, config, q, k, v, seg, temp, None if keys is None else keys.segment_ids)
  key_inputs, key_specs = _key_block_inputs(keys, seq_pad)
  bq, bkv = blocks["block_q"], blocks["block_kv"]
  kernel = functools.partial(kernels.forward_kernel, spec=spec, block_q=bq,
                             block_kv=bkv, padded=seq_pad != t,
                             fast_cap=_fast_cap(spec, q.dtype))
  tile, whole_kv, row = _query_program_specs(spec, bq, head_dim, seq_pad)
  rows = jax.ShapeDtypeStruct((b, hq, seq_pad), jnp.float32)
  out, shift, *low = _pallas_call(
      config, (q, k, v, seg, spans, temp, *key_inputs), kernel,
      grid=(seq_pad // bq, b, hq),
      in_specs=[tile, whole_kv, whole_kv, *_segment_specs(seg, spans, seq_pad),
                None if temp is None else row, *key_specs],
      out_specs=[tile, row] + [row] * keep_low,
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), rows] + [rows] * keep_low,
      compiler_params=_compiler_params(config),
      name="ua_forward",
  )
  return out[:, :t, :, :d], shift[:, :, :t], low[0][:, :, :t] if low else None


def backward_backend(spec: StaticSpec, config: KernelConfig, dtype, keys=None) -> str:
  """"mosaic" or "triton": the kernels of the backward, the forward's backend
  where its backward supports the call (the Mosaic one: head dims up to 256,
  above 128 with tiles whose shared memory fits; mosaic_backward.unsupported).
  ``config`` as given or effective: its unset tiles are the table's here too."""
  config = effective_config(spec, dtype, config)
  if (forward_backend(spec, config, dtype, keys) == "mosaic"
      and mosaic_backward.unsupported(spec, dtype, config.mosaic) is None):
    return "mosaic"
  return "triton"


def _delta(spec: StaticSpec, out, dout, lse2, dlse):
  """[B, Hq, T] float32: rowsum(dO * O) - dlse - w * lse, 0 on rows without a
  visible key (lse2 = -inf), the one per-row term of d logits = p * (dp - delta).

  Computed as its own XLA reduction (the optimization barrier): left free, XLA
  fused the row sums into their consumer, the stack of per-query rows of the
  Mosaic backward (mosaic_backward.backward), one loop fusion several times
  slower than the reduction alone (docs/BENCHMARKS.md, "Where the
  forward+backward time goes")."""
  lse = lse2 * LN2
  delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32),
                     dout.astype(jnp.float32)) - dlse - spec.z_loss_weight * lse
  return jax.lax.optimization_barrier(jnp.where(lse2 != -jnp.inf, delta, 0.0))


def _backward(spec: StaticSpec, config: KernelConfig, q, k, v, seg, temp, out, shift,
              low, dout, dlse, keys: KeyBlock | None = None):
  """(dq, dk, dv); ``shift`` and ``low`` as _forward returns them; ``config``
  is effective (effective_config)."""
  config.require_filled("ua_kernels.attention's backward")
  delta = _delta(spec, out, dout, _lse2(spec, temp, shift, low), dlse)
  if backward_backend(spec, config, q.dtype, keys) == "mosaic":
    return mosaic_backward.backward(spec, config.mosaic, q, k, v, seg, temp, shift, delta, dout,
                                    fast_cap=_fast_cap(spec, q.dtype))
  b, t, hq, d = q.shape
  hkv, group = spec.num_kv_heads, spec.group_size
  q, k, v, seg, spans, temp, head_dim, seq_pad, blocks = _prepare(
      spec, config, q, k, v, seg, temp, None if keys is None else keys.segment_ids)
  key_inputs, key_specs = _key_block_inputs(keys, seq_pad)
  dout = _pad(dout, {1: seq_pad, 3: head_dim})
  shift = _pad(shift, {2: seq_pad})
  if low is not None:
    low = _pad(low, {2: seq_pad})
  delta = _pad(delta, {2: seq_pad})
  padded = seq_pad != t
  fast_cap = _fast_cap(spec, q.dtype)
  segment_specs = _segment_specs(seg, spans, seq_pad)
  params = dict(compiler_params=_compiler_params(config, backward=True))
  inputs = (q, k, v, seg, spans, temp, *key_inputs, dout, shift, low, delta)
  has_low = low is not None

  # dq: one program per (query tile, batch, query head).
  bq, bkv = blocks["block_q_dq"], blocks["block_kv_dq"]
  tile, whole_kv, row = _query_program_specs(spec, bq, head_dim, seq_pad)
  dq = _pallas_call(
      config, inputs, functools.partial(kernels.dq_kernel, spec=spec, block_q=bq, block_kv=bkv,
                        padded=padded, fast_cap=fast_cap),
      grid=(seq_pad // bq, b, hq),
      in_specs=[tile, whole_kv, whole_kv, *segment_specs,
                None if temp is None else row, *key_specs, tile, row,
                row if has_low else None, row],
      out_specs=tile,
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      name="ua_backward_dq", **params,
  )

  # dk/dv: one program per (key tile, batch, kv head); loops over the group.
  bq, bkv = blocks["block_q_dkv"], blocks["block_kv_dkv"]
  kv_tile = pl.BlockSpec((None, bkv, None, head_dim), lambda j, bi, h: (bi, j, h, 0))
  group_q = pl.BlockSpec((None, seq_pad, group, head_dim), lambda j, bi, h: (bi, 0, h, 0))
  group_rows = pl.BlockSpec((None, group, seq_pad), lambda j, bi, h: (bi, h, 0))
  dk, dv = _pallas_call(
      config, inputs, functools.partial(kernels.dkv_kernel, spec=spec, block_q=bq, block_kv=bkv,
                        padded=padded, fast_cap=fast_cap,
                        per_head_totals=_per_head_totals(spec, q.dtype)),
      grid=(seq_pad // bkv, b, hkv),
      in_specs=[group_q, kv_tile, kv_tile, *segment_specs,
                None if temp is None else group_rows, *key_specs, group_q, group_rows,
                group_rows if has_low else None, group_rows],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype)] * 2,
      name="ua_backward_dkv", **params,
  )
  return dq[:, :t, :, :d], dk[:, :t, :, :d], dv[:, :t, :, :d]


def _first_order_only(fn):
  """``fn`` (the forward's or the backward's kernels, under the VJP), whose
  own derivative raises a clear error: a gradient of a gradient reaches the
  Pallas calls, which have none, and failed with a bare AssertionError."""
  @jax.custom_jvp
  def first_order(*args):
    return fn(*args)

  @first_order.defjvp
  def _second_order(primals, tangents):
    raise NotImplementedError(
        "ua_kernels.attention: second-order gradients (differentiating its backward, "
        "e.g. jax.grad of jax.grad) are not supported; ua_reference.attention has them")
  return first_order


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(spec, config, q, k, v, seg, temp, keys=None):
  out, shift, low = _forward(spec, config, q, k, v, seg, temp, keys=keys)
  return out, _lse2(spec, temp, shift, low) * LN2


def _attention_fwd(spec, config, q, k, v, seg, temp, keys=None):
  forward = _first_order_only(lambda q, k, v, seg, temp, keys: _forward(
      spec, config, q, k, v, seg, temp, keys=keys))
  out, shift, low = forward(q, k, v, seg, temp, keys)
  return (out, _lse2(spec, temp, shift, low) * LN2), (q, k, v, seg, temp, keys, out, shift, low)


def _attention_bwd(spec, config, residuals, cotangents):
  q, k, v, seg, temp, keys, out, shift, low = residuals
  dout, dlse = cotangents
  backward = _first_order_only(functools.partial(_backward, spec, config))
  dq, dk, dv = backward(q, k, v, seg, temp, out, shift, low, dout, dlse, keys)
  # segment_ids, temperature and the key block receive no gradient (docs/SEMANTICS.md).
  return dq, dk, dv, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
_jitted_attention = jax.jit(_attention, static_argnums=(0, 1))


def attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
              cap_method="none", cap_params=(), temperature=None, sm_scale=None,
              z_loss_weight=0.0, return_lse=False, config: KernelConfig | None = None):
  """Unified attention through the Pallas kernels; see docs/SEMANTICS.md."""
  spec, segment_ids, temperature = validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=window_len,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, z_loss_weight=z_loss_weight, return_lse=return_lse)
  if q.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"ua_kernels.attention supports q/k/v dtypes float32, bfloat16 "
                    f"and float16, got {q.dtype}")
  if temperature is not None:
    temperature = temperature.astype(jnp.float32)
  # Unset fields take the tuned table's values before jit: the effective
  # config keys the compilation, whichever backend the call forces.
  config = effective_config(spec, q.dtype, config)
  out, lse = _jitted_attention(spec, config, q, k, v, segment_ids, temperature)
  return (out, lse) if return_lse else out


def attention_block(q, k, v, *, offset, segment_ids=None, kv_segment_ids=None, causal=False,
                    window_len=0, cap_method="none", cap_params=(), temperature=None,
                    sm_scale=None, config: KernelConfig | None = None):
  """(out, lse) of a block of queries against a block of keys from elsewhere in
  the same sequence: the queries' positions lie ``offset`` (an int32 scalar,
  traced or not) after the keys'; ``segment_ids`` are the queries',
  ``kv_segment_ids`` the keys' (both or neither). ``window_len`` is the
  sequence's (not clamped to this block's length). Gradients flow to q, k, v
  and lse as in ``attention``; the Triton kernels run it. For
  context_parallel, which merges such blocks through their lse."""
  if (segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("segment_ids and kv_segment_ids go together: the queries' and the "
                     "keys' own")
  spec, segment_ids, temperature = validate(
      q, k, v, segment_ids=segment_ids, causal=causal, window_len=0,
      cap_method=cap_method, cap_params=cap_params, temperature=temperature,
      sm_scale=sm_scale, return_lse=True)
  if isinstance(window_len, bool) or not isinstance(window_len, int) or window_len < 0:
    raise ValueError(f"window_len must be a non-negative int, got {window_len!r}")
  spec = dataclasses.replace(spec, window_len=window_len)
  if kv_segment_ids is not None:
    kv_segment_ids = jnp.asarray(kv_segment_ids)
    if kv_segment_ids.shape != segment_ids.shape or not jnp.issubdtype(
        kv_segment_ids.dtype, jnp.integer):
      raise ValueError(f"kv_segment_ids must be integers of shape {segment_ids.shape} (the "
                       f"keys' [B, T]), got {kv_segment_ids.dtype}{list(kv_segment_ids.shape)}")
    kv_segment_ids = kv_segment_ids.astype(jnp.int32)
  if temperature is not None:
    temperature = temperature.astype(jnp.float32)
  config = effective_config(spec, q.dtype, config)
  keys = KeyBlock(kv_segment_ids, jnp.asarray(offset, jnp.int32))
  return _jitted_attention(spec, config, q, k, v, segment_ids, temperature, keys)


def _config_for_tiles(block_q: int, block_kv: int) -> KernelConfig:
  """The suite's tile pair (docs/PLUGINS.md, ``ua_config``) as a KernelConfig: the
  forward and dk/dv kernels take (block_q, block_kv), the dq kernel the pair
  swapped, so that one drawn pair exercises unequal tiles both ways; warps,
  stages and the Mosaic tiles stay the tuned table's."""
  return KernelConfig(block_q, block_kv, block_kv, block_q, block_q, block_kv)


# Capability declarations read by the verification suite (docs/PLUGINS.md).
attention.ua_dtypes = tuple(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
attention.ua_block_sizes = (16, 32, 64, 128)  # default tiles (tuned_configs), clipped to T
attention.ua_config = _config_for_tiles
attention.ua_cap_forms = cap_forms.fast_forms
