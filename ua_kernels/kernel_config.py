"""Tile sizes and launch parameters of the three kernels."""

from __future__ import annotations

import dataclasses

_WARPS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Frozen, hashable kernel tuning; it keys compilation, so it must be static.

  Block sizes are powers of two >= 16 (Triton's dot needs 16-row tiles); each is
  clipped to the padded sequence length at call time. ``interpret=None`` picks
  the Pallas interpreter exactly when no GPU backend is present.
  """

  block_q: int = 64
  block_kv: int = 64
  block_q_dq: int = 64
  block_kv_dq: int = 64
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  num_warps: int | None = None
  num_stages: int = 2
  num_warps_bwd: int | None = None
  num_stages_bwd: int = 2
  interpret: bool | None = None

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq",
                  "block_q_dkv", "block_kv_dkv"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KernelConfig.{field} must be an int, got {value!r}")
      if value < 16 or value & (value - 1):
        raise ValueError(
            f"KernelConfig.{field} must be a power of two >= 16, got {value}")
    for field in ("num_warps", "num_warps_bwd"):
      value = getattr(self, field)
      if value is not None and value not in _WARPS:
        raise ValueError(f"KernelConfig.{field} must be one of {_WARPS} or None, "
                         f"got {value!r}")
    for field in ("num_stages", "num_stages_bwd"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KernelConfig.{field} must be an int >= 1, got {value!r}")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise TypeError(
          f"KernelConfig.interpret must be a bool or None, got {self.interpret!r}")
