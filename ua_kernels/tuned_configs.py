"""Default KernelConfig per (head dim, dtype, masking, cap), from benchmarks/tune.py.

16-bit tiles: measured on one H200 (jax 0.11.2, triton 3.6, bf16, B=4 (2 for
D=256), T=4096, H=16), candidates timed round-robin. D=128 forward tiles: no cap
128x128, 8 warps, 3 stages, full and causal; tanh cap 64x64, 4 warps, 3 stages;
windows keep the 64x64 tiles they were measured with. float32 tiles hold twice
the bytes, so for D > 64 float32 keeps untuned tiles that fit the H200's 227 KiB
of shared memory per block and ran there (D=256 at 64x32); float32 is
correctness-first here, not tuned. The sweeps and the float32 runs behind these
choices: docs/BENCHMARKS.md, "Tiles". The CPU interpreter ignores warps and stages.
"""

from __future__ import annotations

import jax.numpy as jnp

from ua_reference.contract import StaticSpec

from .kernel_config import KernelConfig

_BWD_64 = dict(block_q_dq=64, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=64,
               num_warps_bwd=4, num_stages_bwd=2)


def default_config(spec: StaticSpec, dtype) -> KernelConfig:
  if jnp.dtype(dtype) == jnp.float32 and spec.head_dim > 128:
    return KernelConfig(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=32,
                        block_q_dkv=32, block_kv_dkv=32)
  if jnp.dtype(dtype) == jnp.float32 and spec.head_dim > 64:
    return KernelConfig()
  if spec.head_dim > 128:
    return KernelConfig(block_q=128, block_kv=64, num_warps=8, num_stages=2,
                        block_q_dq=32, block_kv_dq=64, block_q_dkv=64, block_kv_dkv=32,
                        num_warps_bwd=4, num_stages_bwd=2)
  if spec.head_dim > 64 and spec.cap_method == "none" and spec.window_len == 0:
    return KernelConfig(block_q=128, block_kv=128, num_warps=8, num_stages=3, **_BWD_64)
  return KernelConfig(block_q=64, block_kv=64, num_warps=4, num_stages=3, **_BWD_64)
