"""Pallas-Triton's tuned table: blocks, warps and stages per (head dim, dtype,
masking, cap), from ``python -m benchmarks.tune [--dtype float32]``, candidates
timed round-robin on the GPU. float32 products run on FMA units (precision
HIGHEST), so tiles of 32 keys win above D=64 and in every backward, and compile
far faster than 64x64 ones (a GPU campaign compiles one per configuration).
The sweeps: docs/BENCHMARKS.md, "Tiles". The CPU interpreter ignores warps and
stages."""

from __future__ import annotations

import jax.numpy as jnp

from ua_reference.contract import StaticSpec

from ..kernel_config import KernelConfig

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
