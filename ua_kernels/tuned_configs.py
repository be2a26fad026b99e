"""Default KernelConfig per (head dim, dtype, masking)."""

from __future__ import annotations

from .contract import StaticSpec
from .kernel_config import KernelConfig


def default_config(spec: StaticSpec, dtype) -> KernelConfig:
  del dtype
  if spec.head_dim > 128:
    return KernelConfig(block_q=64, block_kv=32, block_q_dq=32, block_kv_dq=32,
                        block_q_dkv=32, block_kv_dkv=32)
  return KernelConfig()
