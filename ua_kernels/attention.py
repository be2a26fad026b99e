"""The public op: validation, the backend choice, and the custom VJP.

Each backend's launch code has its own package (ua_kernels.triton,
ua_kernels.mosaic); this module decides once per call which one runs the
forward and which the backward (backends_for), and owns what both share. The
forward saves only O(T) residuals besides the inputs (out and each row's
softmax statistics, SoftmaxState.finalize's shift and, for float32, low); the
backward folds the lse cotangent and the z-loss into delta, so the kernels
need no extra inputs for them:
  d logits = p * (dp - delta),  delta = rowsum(dO * O) - dlse - w * lse.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ua_reference.contract import StaticSpec, validate, validate_call

from . import cap_forms
from .kernel_config import KernelConfig
from .mosaic import backward as mosaic_backward
from .mosaic import forward as mosaic_forward
from .tile_math import LN2, exp2_scale
from .triton import decode as triton_decode
from .triton import launch as triton_launch
from .triton.launch import KeyBlock
from .tuned_configs import effective_config

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _is_hopper() -> bool:
  """Whether the default device is an sm90 GPU (H100, H200): wgmma and the
  TMA engine as Mosaic's Hopper lowering uses them exist there only."""
  device = jax.devices()[0]
  return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9.")


class Backends(NamedTuple):
  """The kernels of one call: "mosaic" or "triton" for its forward, and for its
  backward "mosaic", "mosaic_fused" (one kernel, dq added up across key tiles
  in the order the hardware takes: deterministic=False), "mosaic_fused_ordered"
  (one kernel, dq's adds in key-tile order: MosaicTiles.ordered_fused) or
  "triton". Decided
  once (backends_for), before the trace, and carried as a static argument, so
  that the forward and the backward cannot disagree."""

  forward: str
  backward: str


def _other_keys(spec: StaticSpec, block_keys: bool) -> bool:
  """Whether the keys are not the queries' own positions: another length, an
  offset (None: traced), or a KeyBlock (``block_keys``)."""
  return block_keys or spec.kv_seq_len != spec.seq_len or spec.q_offset != 0


def _forward_backend(spec: StaticSpec, config: KernelConfig, dtype, block_keys: bool) -> str:
  if config.backend == "triton":
    return "triton"
  why = mosaic_forward.unsupported(spec, dtype)
  other_keys = _other_keys(spec, block_keys)
  if other_keys and spec.has_segment_ids:
    why = ("segment ids with keys of another length or offset (the keys' own ids, "
           "context_parallel's key blocks) run on Triton only")
  if config.backend == "mosaic":
    if why:
      raise ValueError(f"KernelConfig(backend='mosaic'): {why}")
    if config.interpret:
      raise ValueError("KernelConfig(backend='mosaic') cannot run in the Pallas interpreter "
                       "(interpret=True)")
    return "mosaic"
  # Sinks and keys of another length or offset take the Mosaic forward when asked for;
  # "auto" keeps them on Triton until it has run compiled (docs/SEMANTICS.md, "Signature").
  if why is None and not spec.has_sinks and not other_keys \
      and not triton_launch.interpreted(config) and _is_hopper():
    return "mosaic"
  return "triton"


def backends_for(spec: StaticSpec, config: KernelConfig | None, dtype,
                 block_keys: bool = False, deterministic: bool = True) -> Backends:
  """The backends of a call (KernelConfig.backend). "auto" takes Mosaic on
  Hopper for 16-bit inputs and head dims up to 256, equal lengths without an
  offset or sinks; the Mosaic forward takes those too when asked for, but not
  with segment ids (keys from elsewhere, ``block_keys``: a KeyBlock, with
  their own ids). The backward runs on the forward's backend where that
  backend's backward supports the call (the Mosaic one: the queries' own keys,
  head dims up to 256, above 128 with tiles whose shared memory fits;
  mosaic.backward.unsupported), else on Triton; the fused Mosaic backward
  where it runs (mosaic.backward.fused_unsupported) when not ``deterministic``,
  or deterministic with MosaicTiles.ordered_fused; the others where not (their
  reruns are bitwise identical anyway). ``config`` as given or effective: its
  unset tiles are the table's here too."""
  config = effective_config(spec, dtype, config)
  forward = _forward_backend(spec, config, dtype, block_keys)
  backward = ("mosaic" if forward == "mosaic" and not _other_keys(spec, block_keys)
              and mosaic_backward.unsupported(spec, dtype, config.mosaic) is None else "triton")
  if (backward == "mosaic" and (not deterministic or config.mosaic.ordered_fused)
      and mosaic_backward.fused_unsupported(spec, dtype, config.mosaic) is None):
    backward = "mosaic_fused" if not deterministic else "mosaic_fused_ordered"
  return Backends(forward, backward)


def _lse2(spec: StaticSpec, temp, shift, low):
  """The base-2 lse [B, Hq, T] from the forward's row statistics (-inf on rows
  without a visible key)."""
  lse2 = shift * exp2_scale(spec, temp is not None)
  return lse2 if low is None else lse2 + low


def _forward(spec: StaticSpec, config: KernelConfig, backends: Backends, q, k, v, seg, temp,
             keys: KeyBlock | None = None, sinks=None):
  """(out, shift, low): the rows' statistics of SoftmaxState.finalize, low
  None but for the Triton kernels' float32 (triton.launch.keeps_low).
  ``config`` is effective (effective_config)."""
  config.require_filled("ua_kernels.attention's forward")
  fast_cap = cap_forms.fast_cap(spec, q.dtype)
  if backends.forward == "mosaic":
    return (*mosaic_forward.forward(spec, config.mosaic, q, k, v, seg, temp, fast_cap=fast_cap,
                                    sinks=sinks, offset=None if keys is None else keys.offset),
            None)
  launch = triton_decode if triton_decode.applies(spec, config) else triton_launch
  return launch.forward(spec, config, q, k, v, seg, temp, keys, fast_cap=fast_cap, sinks=sinks)


def _delta(spec: StaticSpec, out, dout, lse2, dlse):
  """[B, Hq, T] float32: rowsum(dO * O) - dlse - w * lse, 0 on rows without a
  visible key (lse2 = -inf), the one per-row term of d logits = p * (dp - delta).

  Computed as its own XLA reduction (the optimization barrier): left free, XLA
  fused the row sums into their consumer, the stack of per-query rows of the
  Mosaic backward (mosaic.backward.backward), one loop fusion several times
  slower than the reduction alone (docs/HISTORY.md, "Where the
  forward+backward time goes")."""
  lse = lse2 * LN2
  delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32),
                     dout.astype(jnp.float32)) - dlse - spec.z_loss_weight * lse
  return jax.lax.optimization_barrier(jnp.where(lse2 != -jnp.inf, delta, 0.0))


def _backward(spec: StaticSpec, config: KernelConfig, backends: Backends, q, k, v, seg, temp,
              out, shift, low, dout, dlse, keys: KeyBlock | None = None, delta=None):
  """(dq, dk, dv); ``shift`` and ``low`` as _forward returns them; ``config``
  is effective (effective_config); ``delta``: _delta's, where the caller
  needs it too (d sinks), else computed here."""
  config.require_filled("ua_kernels.attention's backward")
  if delta is None:
    delta = _delta(spec, out, dout, _lse2(spec, temp, shift, low), dlse)
  fast_cap = cap_forms.fast_cap(spec, q.dtype)
  if backends.backward.startswith("mosaic"):
    return mosaic_backward.backward(spec, config.mosaic, q, k, v, seg, temp, shift, delta, dout,
                                    fast_cap=fast_cap, fused=backends.backward != "mosaic",
                                    ordered=backends.backward == "mosaic_fused_ordered")
  return triton_launch.backward(spec, config, q, k, v, seg, temp, shift, low, delta, dout, keys,
                                fast_cap=fast_cap)


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


def _dsinks(sinks, lse2, delta):
  """d sinks [Hq]: -sum over rows of the sink's probability exp(s - lse) times
  delta (docs/SEMANTICS.md); 0 from rows of no mass (lse -inf, delta 0)."""
  p_sink = jnp.exp(sinks[None, :, None] - lse2 * LN2)
  return -jnp.sum(jnp.where(lse2 == -jnp.inf, 0.0, p_sink * delta), axis=(0, 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attention(spec, config, backends, q, k, v, seg, temp, keys=None, sinks=None):
  out, shift, low = _forward(spec, config, backends, q, k, v, seg, temp, keys=keys, sinks=sinks)
  return out, _lse2(spec, temp, shift, low) * LN2


def _attention_fwd(spec, config, backends, q, k, v, seg, temp, keys=None, sinks=None):
  forward = _first_order_only(lambda q, k, v, seg, temp, keys, sinks: _forward(
      spec, config, backends, q, k, v, seg, temp, keys=keys, sinks=sinks))
  out, shift, low = forward(q, k, v, seg, temp, keys, sinks)
  return ((out, _lse2(spec, temp, shift, low) * LN2),
          (q, k, v, seg, temp, keys, sinks, out, shift, low))


def _attention_bwd(spec, config, backends, residuals, cotangents):
  q, k, v, seg, temp, keys, sinks, out, shift, low = residuals
  dout, dlse = cotangents
  backward = _first_order_only(functools.partial(_backward, spec, config, backends))
  if sinks is None:
    dq, dk, dv = backward(q, k, v, seg, temp, out, shift, low, dout, dlse, keys)
    dsinks = None
  else:  # one delta for the kernels and d sinks
    lse2 = _lse2(spec, temp, shift, low)
    delta = _delta(spec, out, dout, lse2, dlse)
    dq, dk, dv = backward(q, k, v, seg, temp, out, shift, low, dout, dlse, keys, delta)
    dsinks = _dsinks(sinks, lse2, delta).astype(sinks.dtype)
  # segment_ids, temperature and the key block receive no gradient (docs/SEMANTICS.md).
  return dq, dk, dv, None, None, None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)
_jitted_attention = jax.jit(_attention, static_argnums=(0, 1, 2))


def attention(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, sinks=None,
              causal=False, window_len=0, cap_method="none", cap_params=(), temperature=None,
              sm_scale=None, z_loss_weight=0.0, return_lse=False, deterministic=True,
              config: KernelConfig | None = None):
  """Unified attention through the Pallas kernels; see docs/SEMANTICS.md.
  ``deterministic=False`` lets the backward add dq's parts in the order the
  hardware takes (the fused Mosaic backward, where it runs: backends_for), so
  that reruns may differ in the last bits of dq."""
  call = validate_call(
      q, k, v, segment_ids=segment_ids, kv_segment_ids=kv_segment_ids, q_offset=q_offset,
      sinks=sinks, causal=causal, window_len=window_len, cap_method=cap_method,
      cap_params=cap_params, temperature=temperature, sm_scale=sm_scale,
      z_loss_weight=z_loss_weight, return_lse=return_lse)
  if q.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"ua_kernels.attention supports q/k/v dtypes float32, bfloat16 "
                    f"and float16, got {q.dtype}")
  spec, temperature = call.spec, call.temperature
  if temperature is not None:
    temperature = temperature.astype(jnp.float32)
  keys = None
  if spec.kv_seq_len != spec.seq_len or spec.q_offset != 0 or kv_segment_ids is not None:
    # Keys of their own length, offset or segments: the key-block path of the
    # Triton kernels, the offset traced (one compile for every offset).
    keys = KeyBlock(None if kv_segment_ids is None else call.kv_segment_ids,
                    jnp.asarray(call.q_offset, jnp.int32))
    spec = dataclasses.replace(spec, q_offset=None)
  # Unset fields take the tuned table's values before jit: the effective
  # config keys the compilation, whichever backend the call forces.
  config = effective_config(spec, q.dtype, config)
  if not isinstance(deterministic, bool):
    raise TypeError(f"deterministic must be True or False, got {deterministic!r}")
  backends = backends_for(spec, config, q.dtype, block_keys=keys is not None,
                          deterministic=deterministic)
  out, lse = _jitted_attention(spec, config, backends, q, k, v, call.segment_ids, temperature,
                               keys, call.sinks)
  return (out, lse) if return_lse else out


def attention_block(q, k, v, *, offset, segment_ids=None, kv_segment_ids=None, causal=False,
                    window_len=0, cap_method="none", cap_params=(), temperature=None,
                    sm_scale=None, config: KernelConfig | None = None):
  """(out, lse) of a block of queries against a block of keys from elsewhere in
  the same sequence: the queries' positions lie ``offset`` (an int32 scalar,
  traced or not) after the keys'; ``segment_ids`` are the queries',
  ``kv_segment_ids`` the keys' (both or neither). ``window_len`` is the
  sequence's (not clamped to this block's length). Gradients flow to q, k, v
  and lse as in ``attention``; the Triton kernels run it (the Mosaic forward
  when asked for, without segment ids; its backward on Triton). For
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
  backends = backends_for(spec, config, q.dtype, block_keys=True)
  return _jitted_attention(spec, config, backends, q, k, v, segment_ids, temperature, keys)


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
