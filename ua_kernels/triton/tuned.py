"""Pallas-Triton's tuned table: blocks, warps and stages per (head dim, dtype,
masking, cap), from ``python -m benchmarks.tune [--dtype float32]``, candidates
timed round-robin on the GPU. float32 products run on FMA units (precision
HIGHEST), so tiles of 32 keys win above D=64 and in every backward, and compile
far faster than 64x64 ones (a GPU campaign compiles one per configuration).
The sweeps: docs/BENCHMARKS.md, "Tiles". The CPU interpreter ignores warps and
stages."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ua_reference.contract import StaticSpec

from .. import devices
from ..kernel_config import KernelConfig
from .launch import clipped_block

_BWD_64 = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
               num_warps_bwd=4, num_stages_bwd=2)
_STAGES_2 = dict(num_stages=2, num_stages_bwd=2)
_WARPS_8 = dict(num_warps=8, num_warps_bwd=8)


# Split-K (kv_splits): decode only (the queries fit one tile), each split at
# least this many key tiles, and about this many programs per multiprocessor.
DECODE_MAX_QUERIES = 16
MIN_TILES_PER_SPLIT = 4
PROGRAMS_PER_MULTIPROCESSOR = 2


def kv_splits(spec: StaticSpec, block_q: int, block_kv: int, packed: bool) -> int:
  """How many key ranges the forward splits into: 1 unless a decode call's
  programs (one per query tile and head; with ``packed`` GQA heads, one per
  tile of a group's rows and kv head) would leave multiprocessors idle; then
  enough splits for PROGRAMS_PER_MULTIPROCESSOR programs each, none shorter
  than MIN_TILES_PER_SPLIT tiles. docs/BENCHMARKS.md, "Decode"."""
  if spec.seq_len > DECODE_MAX_QUERIES:
    return 1
  rows = spec.seq_len * (spec.group_size if packed else 1)
  heads = spec.num_kv_heads if packed else spec.num_q_heads
  programs = -(-rows // clipped_block(block_q, rows)) * spec.batch * heads
  tiles = -(-spec.kv_seq_len // clipped_block(block_kv, spec.kv_seq_len))
  wanted = -(-PROGRAMS_PER_MULTIPROCESSOR * devices.multiprocessors() // programs)
  return max(1, min(wanted, tiles // MIN_TILES_PER_SPLIT))


def triton_config(spec: StaticSpec, dtype) -> KernelConfig:
  """Every Pallas-Triton field (blocks, warps, stages, kv_splits, pack_gqa) of the table;
  ``mosaic`` unset."""
  config = _tiles(spec, dtype)
  packed = pack_gqa(spec)
  return dataclasses.replace(
      config, kv_splits=kv_splits(spec, config.block_q, config.block_kv, packed), pack_gqa=packed)


def pack_gqa(spec: StaticSpec) -> bool:
  """Whether the decode forward packs a GQA group's query heads as rows: for
  decode (the queries fit one tile) with a group of more than one head."""
  return spec.seq_len <= DECODE_MAX_QUERIES and spec.group_size > 1


def _tiles(spec: StaticSpec, dtype) -> KernelConfig:
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
