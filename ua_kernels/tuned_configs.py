"""The tuned table: each kernel field's value per (head dim, dtype, masking,
cap), from benchmarks/tune.py, and the one place a call's effective config is
made from it (effective_config).

Pallas-Triton, 16-bit and float32 (`python -m benchmarks.tune [--dtype
float32]`), and Mosaic GPU, 16-bit only (`python -m benchmarks.tune --backend
mosaic`), candidates timed round-robin on the GPU. float32 products run on FMA
units (precision HIGHEST), so tiles of 32 keys win above D=64 and in every
backward, and compile far faster than 64x64 ones (a GPU campaign compiles one
per configuration). The sweeps behind these choices: docs/BENCHMARKS.md,
"Tiles". The CPU interpreter ignores warps and stages.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ua_reference.contract import StaticSpec

from .kernel_config import KernelConfig, MosaicTiles

_BWD_64 = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
               num_warps_bwd=4, num_stages_bwd=2)
_STAGES_2 = dict(num_stages=2, num_stages_bwd=2)
_WARPS_8 = dict(num_warps=8, num_warps_bwd=8)


def triton_config(spec: StaticSpec, dtype) -> KernelConfig:
  """Every Pallas-Triton field (blocks, warps, stages) of the table; ``mosaic`` unset."""
  if jnp.dtype(dtype) == jnp.float32 and spec.head_dim > 128:
    return KernelConfig(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=32,
                        block_q_dkv=32, block_kv_dkv=32, **_WARPS_8, **_STAGES_2)
  if jnp.dtype(dtype) == jnp.float32 and spec.head_dim > 64:
    return KernelConfig(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=32,
                        block_q_dkv=32, block_kv_dkv=32, num_warps=4, num_warps_bwd=4,
                        **_STAGES_2)
  if jnp.dtype(dtype) == jnp.float32:
    return KernelConfig(block_q=64, block_kv=64, block_q_dq=32, block_kv_dq=32,
                        block_q_dkv=32, block_kv_dkv=32, num_warps=8, num_stages=2,
                        num_warps_bwd=4, num_stages_bwd=1)
  if spec.head_dim > 128:
    return KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2,
                        block_q_dq=32, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=32,
                        num_warps_bwd=4, num_stages_bwd=2)
  if spec.head_dim > 64 and spec.cap_method == "none" and spec.window_len == 0:
    return KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3, **_BWD_64)
  return KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3, **_BWD_64)


# The longest sequence whose full forward the table runs persistent (mosaic_tiles):
# it gained at 1k and 4k and not at 16k (docs/BENCHMARKS.md); between them is unmeasured.
PERSISTENT_MAX_SEQ_LEN = 4096


def mosaic_tiles(spec: StaticSpec, dtype) -> MosaicTiles:
  """Every MosaicTiles field of the table: forward key tiles of 128 up to head
  dim 128, else 64 (two stages of K and V at head dim 256 fit the shared memory
  only so); 128-key dq tiles beat 64 at head dim 128. The forward
  is persistent without a causal mask or a window, up to PERSISTENT_MAX_SEQ_LEN
  keys: what it saves is one prologue and epilogue per item, which matters
  where items are short (docs/BENCHMARKS.md, "The persistent forward"). Under
  a causal mask or a window the items' work follows the query tile, and dealt
  round-robin they leave multiprocessors idle at the end; packed documents'
  items, whose work follows the documents, gained from it even where one row
  is one document and the others 32 short ones (docs/BENCHMARKS.md, "Packed
  documents: the persistent forward").
  Above head dim 64 the forward overlaps each tile's softmax with the
  previous tile's P @ V, which gained at head dims 128 and 256 and lost at 64
  (docs/BENCHMARKS.md, "The overlapped forward")."""
  del dtype  # measured in bfloat16; float16 has the same bytes
  banded = spec.causal or bool(spec.window_len)
  return MosaicTiles(block_q=64, block_kv=128 if spec.head_dim <= 128 else 64, stages=2,
                     block_q_dq=64, block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64,
                     stages_bwd=2,
                     persistent=not banded and spec.seq_len <= PERSISTENT_MAX_SEQ_LEN,
                     overlap_softmax=spec.head_dim > 64)


def default_config(spec: StaticSpec, dtype) -> KernelConfig:
  """The table's config for a call, every field filled, backend "auto"."""
  return dataclasses.replace(triton_config(spec, dtype), mosaic=mosaic_tiles(spec, dtype))


def effective_config(spec: StaticSpec, dtype, config: KernelConfig | None = None
                     ) -> KernelConfig:
  """The config a call runs with: ``config``'s set fields as given, its unset
  (None) ones from the table for this spec and dtype, whichever backend it
  picks, so that choosing a backend or a few tiles keeps the tuning of the rest.
  Idempotent; None is the table's config."""
  if config is None:
    return default_config(spec, dtype)
  if not isinstance(config, KernelConfig):
    raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
  if not config.unset():
    return config
  return config.filled(default_config(spec, dtype))
