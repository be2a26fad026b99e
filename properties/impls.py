"""Implementations under test: loading ``module:function`` and adapters."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp

from .case import FEATURES

DEFAULT_IMPL = "ua_kernels:attention"


def load_impl(spec: str):
  """Imports ``module:function`` (attributes may be dotted)."""
  if ":" not in spec:
    raise ValueError(f"--impl must look like module:function, got {spec!r}")
  module_name, attr = spec.split(":", 1)
  obj = importlib.import_module(module_name)
  for part in attr.split("."):
    obj = getattr(obj, part)
  if not callable(obj):
    raise TypeError(f"{spec} is not callable")
  unknown = set(unsupported(obj)) - set(FEATURES)
  if unknown:
    raise ValueError(f"{spec}.ua_unsupported names unknown features {sorted(unknown)}; "
                     f"known: {FEATURES}")
  return obj


def unsupported(impl) -> frozenset[str]:
  return frozenset(getattr(impl, "ua_unsupported", ()))


def jax_nn_attention(q, k, v, *, segment_ids=None, causal=False, window_len=0,
                     cap_method="none", cap_params=(), temperature=None, sm_scale=None,
                     z_loss_weight=0.0, return_lse=False, config=None):
  """``jax.nn.dot_product_attention`` (XLA) behind the contract's signature."""
  del config
  if (segment_ids is not None or cap_method != "none" or temperature is not None
      or z_loss_weight or return_lse):
    raise NotImplementedError("jax_nn_attention declares these unsupported")
  t = q.shape[1]
  # Contract window: key j visible iff j > i - window_len (left side only).
  local = (window_len - 1, t) if window_len > 0 else None
  dtype = q.dtype
  if dtype in (jnp.float16, jnp.bfloat16) and jax.default_backend() == "cpu":
    # XLA:CPU has no 16-bit x 16-bit -> float32 dot algorithm for this op.
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  out = jax.nn.dot_product_attention(
      q, k, v, scale=sm_scale, is_causal=causal, local_window_size=local,
      implementation="xla")
  return out.astype(dtype)


jax_nn_attention.ua_unsupported = {"segment_ids", "cap", "temperature", "z_loss", "lse"}


def reference_impl(*args, **kwargs):
  """ua_reference.attention as a plug-in (it must pass its own suite)."""
  import ua_reference
  return ua_reference.attention(*args, **kwargs)
