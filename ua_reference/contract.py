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
from typing import Any

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
  info = np.iinfo(ids.dtype)
  if info.min >= np.iinfo(np.int32).min and info.max <= np.iinfo(np.int32).max:
    return jnp.asarray(ids).astype(jnp.int32)
  if isinstance(ids, np.ndarray):  # before jnp.asarray, which may cast it to 32 bits
    ranks = np.stack([np.searchsorted(np.sort(row), row) for row in ids]) if ids.size else ids
    return jnp.asarray(np.asarray(ranks, np.int32))
  ranks = jax.vmap(jnp.searchsorted)(jnp.sort(ids, axis=1), ids)
  return ranks.astype(jnp.int32)


def validate(q, k, v, *, segment_ids=None, causal=False, window_len=0,
             cap_method="none", cap_params=(), temperature=None, sm_scale=None,
             z_loss_weight=0.0, return_lse=False):
  """Checks one call against the contract.

  Returns ``(spec, segment_ids, temperature)``: the StaticSpec, segment ids as
  int32 [B, T] (or None), and temperature broadcast to [B, T, Hq], float32 (float64 kept)
  (or None).
  """
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
  b, t, hq, d = q.shape
  if k.shape[0] != b or k.shape[1] != t:
    raise ValueError(
        f"k/v must have shape [B={b}, T={t}, Hkv, D], got {k.shape}")
  if k.shape[3] != d:
    raise ValueError(f"head dim mismatch: q has D={d}, k/v have D={k.shape[3]}")
  hkv = k.shape[2]
  if min(b, t, hq, hkv, d) < 1:
    raise ValueError(f"q, k, v must have non-empty dimensions, got q {q.shape}, k {k.shape}")
  if hq % hkv:
    raise ValueError(
        f"number of query heads ({hq}) must be divisible by kv heads ({hkv})")

  causal = _static_bool("causal", causal)
  _static_bool("return_lse", return_lse)
  if isinstance(window_len, bool) or isinstance(window_len, jax.core.Tracer):
    raise TypeError("window_len must be a static non-negative int")
  try:
    window_len = operator.index(window_len)
  except TypeError:
    raise TypeError(
        f"window_len must be a non-negative int, got {type(window_len).__name__}") from None
  if window_len < 0:
    raise ValueError(f"window_len must be >= 0, got {window_len}")
  # A window at least T long hides nothing (j > i - window_len for every
  # j >= 0 > i - T): T is the same window, and keeps the kernels' tile bounds
  # (start + window_len) inside int32.
  window_len = min(window_len, t)

  method = get_cap_method(cap_method)
  params = method.validate_params(cap_params)
  sm_scale = (1.0 / math.sqrt(d)) if sm_scale is None else _static_float("sm_scale", sm_scale)
  z_loss_weight = _static_float("z_loss_weight", z_loss_weight)
  if z_loss_weight < 0:
    raise ValueError(f"z_loss_weight must be >= 0, got {z_loss_weight}")

  if segment_ids is not None:
    segment_ids = _array("segment_ids", segment_ids)
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
      raise TypeError(f"segment_ids must have an integer dtype, got {segment_ids.dtype}")
    if tuple(segment_ids.shape) != (b, t):
      raise ValueError(f"segment_ids must have shape [B, T] = {(b, t)}, got {segment_ids.shape}")
    segment_ids = _int32_ids(segment_ids)

  if temperature is not None:
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
      temperature = np.float32(temperature)
    temperature = _array("temperature", temperature)
    if not jnp.issubdtype(temperature.dtype, jnp.floating):
      raise TypeError(f"temperature must have a floating dtype, got {temperature.dtype}")
    try:
      np.broadcast_shapes(tuple(temperature.shape), (b, t, hq))
      if len(temperature.shape) > 3:
        raise ValueError
    except ValueError:
      raise ValueError(
          f"temperature of shape {tuple(temperature.shape)} does not broadcast to "
          f"[B, T, Hq] = {(b, t, hq)}") from None
    temperature = jnp.asarray(temperature)
    if temperature.dtype != jnp.float64:  # float64 stays, for the float64 oracle
      temperature = temperature.astype(jnp.float32)
    temperature = jnp.broadcast_to(temperature, (b, t, hq))

  spec = StaticSpec(
      batch=b, seq_len=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
      causal=causal, window_len=window_len, cap_method=method.name,
      cap_params=params, sm_scale=sm_scale, z_loss_weight=z_loss_weight,
      has_segment_ids=segment_ids is not None)
  return spec, segment_ids, temperature


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
