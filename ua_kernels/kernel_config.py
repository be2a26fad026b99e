"""Tile sizes and launch parameters of the three kernels."""

from __future__ import annotations

import dataclasses

_WARPS = (1, 2, 4, 8, 16)
BACKENDS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Tiles of the Mosaic GPU kernels, whose programs each have two compute
  warpgroups. Forward: ``block_q`` query rows per compute warpgroup (a program
  owns two such blocks); ``block_kv`` keys per streamed tile (None: 128 up to
  head dim 128, else 64, what fits two stages of K and V in shared memory at
  head dim 256); ``stages``: slots of the K/V ring. Backward: the dq kernel
  owns ``block_q_dq`` query rows per warpgroup and streams ``block_kv_dq``
  keys; the dk/dv kernel owns ``block_kv_dkv`` keys per warpgroup and streams
  ``block_q_dkv`` queries; both with rings of ``stages_bwd`` slots. Above head
  dim 128 the dq kernel streams at most 64 keys, and backward tiles whose
  shared memory does not fit run the backward on Triton
  (mosaic_backward.halves_shared_memory)."""

  block_q: int = 64
  block_kv: int | None = None
  stages: int = 2
  block_q_dq: int = 64
  block_kv_dq: int = 128
  block_q_dkv: int = 64
  block_kv_dkv: int = 64
  stages_bwd: int = 2

  def __post_init__(self):
    for name, allowed in (("block_q", (64, 128)), ("block_kv", (None, 64, 128, 256)),
                          ("block_q_dq", (64, 128)), ("block_kv_dq", (64, 128)),
                          ("block_q_dkv", (64, 128)), ("block_kv_dkv", (64, 128))):
      value = getattr(self, name)
      if not (value is None or type(value) is int) or value not in allowed:
        raise ValueError(f"MosaicTiles.{name} must be one of {allowed} (wgmma tiles), "
                         f"got {value!r}")
    for name in ("stages", "stages_bwd"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ValueError(f"MosaicTiles.{name} must be an int >= 2, got {value!r}")

  def key_block(self, head_dim: int) -> int:
    if self.block_kv is not None:
      return self.block_kv
    return 128 if head_dim <= 128 else 64


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Frozen, hashable kernel tuning; it keys compilation, so it must be static.

  Block sizes are powers of two >= 16 (Triton's dot needs 16-row tiles); each is
  clipped to the padded sequence length at call time. ``interpret=None`` picks
  the Pallas interpreter exactly when no GPU backend is present.

  ``backend`` picks the forward's kernels: "auto" takes Mosaic GPU (tiles in
  ``mosaic``) on Hopper for what it supports (ua_kernels.mosaic_forward) and
  runs faster (not packed documents: attention.forward_backend), and
  Pallas-Triton elsewhere; "triton" and "mosaic" force one (forcing Mosaic for
  a call it cannot run is an error). The backward runs on the forward's
  backend where that backend's backward supports the call
  (ua_kernels.mosaic_backward), else on Pallas-Triton.
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
  backend: str = "auto"
  mosaic: MosaicTiles = MosaicTiles()

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
      if value is not None and (type(value) is not int or value not in _WARPS):
        raise ValueError(f"KernelConfig.{field} must be one of {_WARPS} or None, "
                         f"got {value!r}")
    for field in ("num_stages", "num_stages_bwd"):
      value = getattr(self, field)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"KernelConfig.{field} must be an int >= 1, got {value!r}")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise TypeError(
          f"KernelConfig.interpret must be a bool or None, got {self.interpret!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"KernelConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
    if not isinstance(self.mosaic, MosaicTiles):
      raise TypeError(f"KernelConfig.mosaic must be a MosaicTiles, got {self.mosaic!r}")
