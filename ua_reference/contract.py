"""Argument validation: the contract's "bad input raises" clause as code.

docs/SEMANTICS.md is the contract; this module writes its "bad input" clause
once, so that the reference and any implementation that imports it (the
kernels do) reject exactly the same inputs with the same messages. Everything static (flags, cap method and its
parameters, scales) is normalised into a hashable :class:`StaticSpec` that
can key compilation caches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .caps import CapMethod, get_cap_method


@dataclasses.dataclass(frozen=True)
class StaticSpec:
  """The static (hashable) part of one attention call, after validation."""

  batch: int
  seq_len: int
  num_q_heads: int
  num_kv_heads: int
  head_dim: int
  causal: bool
  window_len: int
  cap_method: str
  cap_params: tuple[float, ...]
  sm_scale: float
  z_loss_weight: float
  has_segment_ids: bool
  # Keys' length (None: the queries', filled in) and the queries' offset among
  # the keys' positions: query i sits at key position i + q_offset. None when
  # the offset is traced (Validated.q_offset holds it); static, it keys compiles.
  kv_seq_len: int | None = None
  q_offset: int | None = 0
  has_sinks: bool = False

  def __post_init__(self):
    if self.kv_seq_len is None:
      object.__setattr__(self, "kv_seq_len", self.seq_len)

  @property
  def group_size(self) -> int:
    return self.num_q_heads // self.num_kv_heads

  @property
  def cap(self) -> CapMethod:
    return get_cap_method(self.cap_method)


def _static_float(name: str, value: Any) -> float:
  if isinstance(value, (bool, str, bytes)):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}")
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a static Python float, not a traced value")
  try:
    out = float(value)
  except (TypeError, ValueError):
    raise TypeError(f"{name} must be a float, got {type(value).__name__}") from None
  if not math.isfinite(out):
    raise ValueError(f"{name} must be finite, got {out!r}")
  why = float32_range_error(out)
  if why:
    raise ValueError(f"{name} {why}")
  return out


_F32 = np.finfo(np.float32)


def float32_range_error(x: float) -> str | None:
  """Why ``x`` cannot be a float32 parameter of the kernels (they compute in
  float32): past its largest value (it would overflow to inf) or below its
  smallest normal value (subnormal: flushed to zero, or a cap that divides
  by it overflows); None for 0 and every normal float32."""
  if x != 0 and not float(_F32.tiny) <= abs(x) <= float(_F32.max):
    return (f"must be 0 or a normal float32 magnitude, in [{float(_F32.tiny):.3g}, "
            f"{float(_F32.max):.3g}], got {x!r}")
  return None


def _static_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
  return bool(value)


def _array(name: str, x: Any) -> jax.Array | np.ndarray:
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  return x


def _int32_ids(ids):
  """Segment ids as int32 with the same equalities: ids of up to 32 bits (not
  uint32) as they are; wider ones as their rank within their row (equal ids
  equal, order kept), which a cast would wrap into collisions (2^32 -> 0)."""
  if _fits_int32(ids.dtype):
    return jnp.asarray(ids).astype(jnp.int32)
  if isinstance(ids, np.ndarray):  # before jnp.asarray, which may cast it to 32 bits
    ranks = np.stack([np.searchsorted(np.sort(row), row) for row in ids]) if ids.size else ids
    return jnp.asarray(np.asarray(ranks, np.int32))
  ranks = jax.vmap(jnp.searchsorted)(jnp.sort(ids, axis=1), ids)
  return ranks.astype(jnp.int32)


class Validated(NamedTuple):
  """One call after validation (validate_call)."""

  spec: StaticSpec
  segment_ids: Any          # int32 [B, Tq], or None
  kv_segment_ids: Any       # int32 [B, Tk]: the keys' (the queries' when Tq = Tk), or None
  temperature: Any          # [B, Tq, Hq], float32 (float64 kept), or None
  q_offset: Any             # the queries' offset: spec.q_offset, or an int32 scalar if traced
  sinks: Any                # [Hq], float32 (float64 kept), or None


# Largest offset, window and length the positions' int32 arithmetic takes
# (i + q_offset - window_len stays within int32).
MAX_POSITION = 1 << 30


def validate(q, k, v, *, segment_ids=None, causal=False, window_len=0,
             cap_method="none", cap_params=(), temperature=None, sm_scale=None,
             z_loss_weight=0.0, return_lse=False):
  """Checks one call of queries and keys of one length against the contract.

  Returns ``(spec, segment_ids, temperature)``: the StaticSpec, segment ids as
  int32 [B, T] (or None), and temperature broadcast to [B, T, Hq], float32 (float64 kept)
  (or None). ``validate_call`` takes every argument (Tq != Tk, offsets, sinks).
  """
  call = _validate(q, k, v, same_length=True, segment_ids=segment_ids, causal=causal,
                   window_len=window_len, cap_method=cap_method, cap_params=cap_params,
                   temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss_weight,
                   return_lse=return_lse)
  return call.spec, call.segment_ids, call.temperature


def validate_call(q, k, v, *, segment_ids=None, kv_segment_ids=None, q_offset=None, sinks=None,
                  causal=False, window_len=0, cap_method="none", cap_params=(),
                  temperature=None, sm_scale=None, z_loss_weight=0.0,
                  return_lse=False) -> Validated:
  """Checks one call against the contract, every argument (docs/SEMANTICS.md)."""
  return _validate(q, k, v, same_length=False, segment_ids=segment_ids,
                   kv_segment_ids=kv_segment_ids, q_offset=q_offset, sinks=sinks, causal=causal,
                   window_len=window_len, cap_method=cap_method, cap_params=cap_params,
                   temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss_weight,
                   return_lse=return_lse)


def _validate(q, k, v, *, same_length, segment_ids=None, kv_segment_ids=None, q_offset=None,
              sinks=None, causal, window_len, cap_method, cap_params, temperature, sm_scale,
              z_loss_weight, return_lse) -> Validated:
  b, tq, tk, hq, hkv, d = _shapes(q, k, v, same_length)
  causal = _static_bool("causal", causal)
  _static_bool("return_lse", return_lse)
  static_offset, offset = _offset(q_offset, tq, tk)
  window_len = _window(window_len, tq, static_offset)
  method = get_cap_method(cap_method)
  params = method.validate_params(cap_params)
  sm_scale = (1.0 / math.sqrt(d)) if sm_scale is None else _static_float("sm_scale", sm_scale)
  z_loss_weight = _static_float("z_loss_weight", z_loss_weight)
  if z_loss_weight < 0:
    raise ValueError(f"z_loss_weight must be >= 0, got {z_loss_weight}")
  segment_ids, kv_segment_ids = _segments(segment_ids, kv_segment_ids, b, tq, tk)
  temperature = _temperature(temperature, b, tq, hq)
  sinks = _sinks(sinks, hq)
  spec = StaticSpec(
      batch=b, seq_len=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
      causal=causal, window_len=window_len, cap_method=method.name,
      cap_params=params, sm_scale=sm_scale, z_loss_weight=z_loss_weight,
      has_segment_ids=segment_ids is not None, kv_seq_len=tk, q_offset=static_offset,
      has_sinks=sinks is not None)
  return Validated(spec, segment_ids, kv_segment_ids, temperature, offset, sinks)


def _shapes(q, k, v, same_length: bool):
  """(B, Tq, Tk, Hq, Hkv, D) of valid q, k, v."""
  q, k, v = _array("q", q), _array("k", k), _array("v", v)
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      raise ValueError(f"{name} must have rank 4 [B, T, H, D], got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must have a floating dtype, got {x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(
        f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape}, v {v.shape}")
  b, tq, hq, d = q.shape
  if k.shape[0] != b or (same_length and k.shape[1] != tq):
    raise ValueError(
        f"k/v must have shape [B={b}, T={tq}, Hkv, D], got {k.shape}" if same_length else
        f"k/v must have shape [B={b}, Tk, Hkv, D] (q's batch), got {k.shape}")
  if k.shape[3] != d:
    raise ValueError(f"head dim mismatch: q has D={d}, k/v have D={k.shape[3]}")
  tk, hkv = k.shape[1], k.shape[2]
  if min(b, tq, tk, hq, hkv, d) < 1:
    raise ValueError(f"q, k, v must have non-empty dimensions, got q {q.shape}, k {k.shape}")
  if max(tq, tk) > MAX_POSITION:
    raise ValueError(f"sequence lengths must be at most 2^30, got Tq={tq}, Tk={tk}")
  if hq % hkv:
    raise ValueError(
        f"number of query heads ({hq}) must be divisible by kv heads ({hkv})")
  return b, tq, tk, hq, hkv, d


def _offset(q_offset, tq: int, tk: int):
  """(the static offset or None, the offset): default Tk - Tq (the last query
  meets the last key); a Python int, or an integer scalar array (traced or not)."""
  if q_offset is None:
    return tk - tq, tk - tq
  if isinstance(q_offset, (bool, np.bool_)):
    raise TypeError("q_offset must be an int or an integer scalar array, got bool")
  if isinstance(q_offset, (int, np.integer)):
    if abs(int(q_offset)) > MAX_POSITION:
      raise ValueError(f"q_offset must lie within +-2^30, got {int(q_offset)}")
    return int(q_offset), int(q_offset)
  if not hasattr(q_offset, "dtype") or not jnp.issubdtype(q_offset.dtype, jnp.integer):
    raise TypeError(f"q_offset must be an int or an integer scalar array, got "
                    f"{getattr(q_offset, 'dtype', type(q_offset).__name__)}")
  if tuple(q_offset.shape) != ():
    raise ValueError(f"q_offset must be a scalar, got shape {tuple(q_offset.shape)}")
  return None, jnp.asarray(q_offset, jnp.int32)


def _window(window_len, tq: int, static_offset: int | None) -> int:
  """window_len as an int; a window no query's keys reach past hides nothing
  and is taken as the least such (Tq + q_offset; T for equal lengths), which keeps
  the kernels' tile bounds inside int32."""
  if isinstance(window_len, bool) or isinstance(window_len, jax.core.Tracer):
    raise TypeError("window_len must be a static non-negative int")
  try:
    window_len = operator.index(window_len)
  except TypeError:
    raise TypeError(
        f"window_len must be a non-negative int, got {type(window_len).__name__}") from None
  if window_len < 0:
    raise ValueError(f"window_len must be >= 0, got {window_len}")
  if window_len == 0:
    return 0
  if static_offset is None:
    return min(window_len, MAX_POSITION)
  # j > i + q_offset - w holds for every key j >= 0 and query i < Tq once w >= Tq + q_offset.
  return min(window_len, max(tq + static_offset, 1))


def _segments(segment_ids, kv_segment_ids, b: int, tq: int, tk: int):
  """(the queries' and the keys' segment ids, int32), or (None, None). Ids
  wider than int32 are ranked over the queries' and the keys' together, so
  that an id keeps one rank on both sides."""
  if segment_ids is None:
    if kv_segment_ids is not None:
      raise ValueError("kv_segment_ids needs segment_ids (the queries' own)")
    return None, None
  segment_ids = _ids("segment_ids", segment_ids, (b, tq), "[B, Tq]")
  if kv_segment_ids is None:
    if tq != tk:
      raise ValueError(f"segment_ids with Tq={tq} != Tk={tk} need kv_segment_ids, the keys' "
                       f"[B, Tk] = {(b, tk)}")
    segment_ids = _int32_ids(segment_ids)
    return segment_ids, segment_ids
  kv_segment_ids = _ids("kv_segment_ids", kv_segment_ids, (b, tk), "[B, Tk]")
  if _fits_int32(segment_ids.dtype) and _fits_int32(kv_segment_ids.dtype):
    return _int32_ids(segment_ids), _int32_ids(kv_segment_ids)
  common = np.promote_types(segment_ids.dtype, kv_segment_ids.dtype)
  if not np.issubdtype(common, np.integer):
    raise TypeError(f"segment_ids ({segment_ids.dtype}) and kv_segment_ids "
                    f"({kv_segment_ids.dtype}) have no common integer dtype: give them one")
  numpy = isinstance(segment_ids, np.ndarray) and isinstance(kv_segment_ids, np.ndarray)
  xp = np if numpy else jnp
  both = _int32_ids(xp.concatenate([segment_ids.astype(common), kv_segment_ids.astype(common)],
                                   axis=1))
  return both[:, :tq], both[:, tq:]


def _ids(name: str, ids, shape, dims: str):
  ids = _array(name, ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {ids.dtype}")
  if tuple(ids.shape) != shape:
    raise ValueError(f"{name} must have shape {dims} = {shape}, got {ids.shape}")
  return ids


def _fits_int32(dtype) -> bool:
  info = np.iinfo(dtype)
  return info.min >= np.iinfo(np.int32).min and info.max <= np.iinfo(np.int32).max


def _temperature(temperature, b: int, tq: int, hq: int):
  if temperature is None:
    return None
  if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
    temperature = np.float32(temperature)
  temperature = _array("temperature", temperature)
  if not jnp.issubdtype(temperature.dtype, jnp.floating):
    raise TypeError(f"temperature must have a floating dtype, got {temperature.dtype}")
  try:
    np.broadcast_shapes(tuple(temperature.shape), (b, tq, hq))
    if len(temperature.shape) > 3:
      raise ValueError
  except ValueError:
    raise ValueError(
        f"temperature of shape {tuple(temperature.shape)} does not broadcast to "
        f"[B, T, Hq] = {(b, tq, hq)}") from None
  return jnp.broadcast_to(_float32_unless_64(temperature), (b, tq, hq))


def _sinks(sinks, hq: int):
  """The per-head sink logits, [Hq] (float32; float64 kept), or None."""
  if sinks is None:
    return None
  sinks = _array("sinks", sinks)
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must have a floating dtype, got {sinks.dtype}")
  if tuple(sinks.shape) != (hq,):
    raise ValueError(f"sinks must have shape [Hq] = ({hq},), got {tuple(sinks.shape)}")
  return _float32_unless_64(sinks)


def _float32_unless_64(x):
  x = jnp.asarray(x)
  return x if x.dtype == jnp.float64 else x.astype(jnp.float32)  # float64: the oracle's


# The contract's z-loss gradient, shared by the reference and any op that merges
# (out, lse) pieces itself (ua_kernels.context_parallel).
@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def with_z_loss_gradient(lse, weight):
  """lse, whose backward adds ``weight * lse`` to its cotangent: the z-loss
  gradient of the contract (the gradient of weight * lse^2 / 2), entering where
  the lse does (rows without a key, lse = -inf, get none)."""
  return lse


def _with_z_loss_fwd(lse, weight):
  return lse, lse


def _with_z_loss_bwd(weight, lse, g):
  return (g + weight * jnp.where(jnp.isfinite(lse), lse, 0.0),)


with_z_loss_gradient.defvjp(_with_z_loss_fwd, _with_z_loss_bwd)
