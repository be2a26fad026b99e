"""Each forward backend as an implementation of its own, for the suite
(``--impl ua_kernels.backends:mosaic_attention``) and for benchmarks.

``ua_kernels.attention`` picks the backend per call (KernelConfig.backend
"auto"); these force one, so that each is verified and timed as itself, with
capability declarations that say what it runs (docs/PLUGINS.md).
"""

from __future__ import annotations

import dataclasses
import inspect

import jax.numpy as jnp

from . import cap_forms
from .attention import SUPPORTED_DTYPES, _config_for_tiles, attention
from .kernel_config import KernelConfig
from .mosaic import backward as mosaic_backward
from .mosaic import common as mosaic_common
from .mosaic import forward as mosaic_forward


def _forced(backend: str, q, k, v, config, kwargs, **mosaic):
  """``config`` (None: every field unset) with its backend replaced, and the
  MosaicTiles fields ``mosaic`` names; ua_kernels.attention fills its unset
  fields from the tuned table (tuned_configs.effective_config), as for any
  config."""
  if config is None:
    config = KernelConfig()
  elif not isinstance(config, KernelConfig):
    raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
  config = dataclasses.replace(config, backend=backend,
                               mosaic=dataclasses.replace(config.mosaic, **mosaic))
  return attention(q, k, v, config=config, **kwargs)


def mosaic_attention(q, k, v, *, sinks=None, config: KernelConfig | None = None, **kwargs):
  """ua_kernels.attention on Pallas Mosaic GPU (Hopper only; bfloat16/float16):
  the forward and the backward for head dims up to 256. ``sinks`` is named:
  the suite draws sinks for a callable whose signature names them."""
  return _forced("mosaic", q, k, v, config, dict(kwargs, sinks=sinks))


def fused_attention(q, k, v, *, sinks=None, config: KernelConfig | None = None, **kwargs):
  """mosaic_attention with ``deterministic=False``: the fused backward, which
  adds each key tile's share of dq into one float32 array in the order the
  GPU's copies arrive (bfloat16, head dims up to 128)."""
  return _forced("mosaic", q, k, v, config, dict(kwargs, sinks=sinks, deterministic=False))


def ordered_attention(q, k, v, *, sinks=None, config: KernelConfig | None = None, **kwargs):
  """mosaic_attention with the deterministic backward as the fused kernel
  (MosaicTiles.ordered_fused): each dq tile's shares added in the order of
  their key tiles (bfloat16, head dims up to 128)."""
  return _forced("mosaic", q, k, v, config, dict(kwargs, sinks=sinks, deterministic=True),
                 ordered_fused=True)


def triton_attention(q, k, v, *, config: KernelConfig | None = None, **kwargs):
  """ua_kernels.attention with every kernel on Pallas-Triton (any GPU, float32,
  and the CPU interpreter)."""
  return _forced("triton", q, k, v, config, kwargs)


mosaic_attention.ua_dtypes = tuple(jnp.dtype(d).name for d in mosaic_common.DTYPES)
mosaic_attention.ua_head_dims = lambda d: d <= mosaic_forward.MAX_HEAD_DIM
# The tuned tiles (mosaic.tuned.mosaic_tiles): a forward program's 2 x 64
# query rows, key tiles of 128 (64 at head dims over 128); the backward's tiles
# of 64 (dq's key tiles 128).
mosaic_attention.ua_block_sizes = (64, 128)
mosaic_attention.ua_cap_forms = cap_forms.fast_forms
# The Mosaic forward takes keys of another length and offsets, but not with segment ids, which
# a declaration cannot say: the suite draws neither for it (docs/PLUGINS.md).
mosaic_attention.ua_unsupported = ("kv_length", "q_offset", "kv_segment_ids")

fused_attention.ua_dtypes = ("bfloat16",)
fused_attention.ua_head_dims = lambda d: d <= mosaic_backward.HALVES_ABOVE
fused_attention.ua_block_sizes = mosaic_attention.ua_block_sizes
fused_attention.ua_cap_forms = cap_forms.fast_forms
fused_attention.ua_unsupported = mosaic_attention.ua_unsupported
fused_attention.ua_deterministic = False

for _name in ("ua_dtypes", "ua_head_dims", "ua_block_sizes", "ua_cap_forms", "ua_unsupported"):
  setattr(ordered_attention, _name, getattr(fused_attention, _name))
ordered_attention.ua_deterministic = True  # bitwise-identical reruns, held to them

# It takes every keyword of the op it forces (the suite reads a callable's signature
# for the keywords of Tq != Tk, offsets and sinks; docs/PLUGINS.md).
triton_attention.__signature__ = inspect.signature(attention)
triton_attention.ua_dtypes = tuple(jnp.dtype(d).name for d in SUPPORTED_DTYPES)
triton_attention.ua_block_sizes = attention.ua_block_sizes
triton_attention.ua_config = lambda bq, bkv: dataclasses.replace(_config_for_tiles(bq, bkv),
                                                                  backend="triton")
triton_attention.ua_cap_forms = cap_forms.fast_forms
