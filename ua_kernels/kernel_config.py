"""Tile sizes and launch parameters of the kernels.

Every tile and launch field defaults to None, "the tuned table's value": the
backend is chosen apart from the tiles, so forcing one (``backend="triton"``)
or setting a few fields keeps the tuned tiles of everything else. A call's
effective config, every None filled for its shape, dtype and backend, comes
from ua_kernels.tuned_configs.effective_config (KernelConfig.filled below).
"""

from __future__ import annotations

import dataclasses

from .mosaic.config import MosaicTiles, require_filled, unset_fields

_WARPS = (1, 2, 4, 8, 16)
BACKENDS = ("auto", "triton", "mosaic")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Frozen, hashable kernel tuning; it keys compilation, so it must be static.

  The Pallas-Triton fields (blocks, warps, stages) and ``mosaic``'s tiles
  default to None, the tuned table's value for the call's head dim, dtype and
  masking (ua_kernels.tuned_configs); set ones are kept as given. Block sizes
  are powers of two >= 16 (Triton's dot needs 16-row tiles); each is clipped
  to the padded sequence length at call time. ``interpret=None`` picks the
  Pallas interpreter exactly when no GPU backend is present.

  ``backend`` picks the forward's kernels and no tiles: "auto" takes Mosaic
  GPU (tiles in ``mosaic``) on Hopper for what it supports
  (ua_kernels.mosaic; attention.backends_for), and Pallas-Triton
  elsewhere; "triton" and "mosaic" force one (forcing Mosaic for a call it
  cannot run is an error).
  The backward runs on the forward's backend where that backend's backward
  supports the call (ua_kernels.mosaic.backward), else on Pallas-Triton.

  ``kv_splits``: the Pallas-Triton forward cuts the keys into this many
  ranges, one program each, and combines their partial softmaxes (split-K);
  the table takes more than 1 for decode, where one query tile per head
  leaves the GPU idle (ua_kernels.triton.tuned.kv_splits). ``pack_gqa``: that
  forward packs a GQA group's query heads as the rows of one tile, so that
  its keys are read once for the group (ua_kernels.triton.decode).
  """

  block_q: int | None = None
  block_kv: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  block_q_dkv: int | None = None
  block_kv_dkv: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  num_warps_bwd: int | None = None
  num_stages_bwd: int | None = None
  kv_splits: int | None = None
  pack_gqa: bool | None = None
  interpret: bool | None = None
  backend: str = "auto"
  mosaic: MosaicTiles = MosaicTiles()

  def __post_init__(self):
    for field in ("block_q", "block_kv", "block_q_dq", "block_kv_dq",
                  "block_q_dkv", "block_kv_dkv"):
      value = getattr(self, field)
      if value is None:
        continue
      if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"KernelConfig.{field} must be an int or None (tuned), got {value!r}")
      if value < 16 or value & (value - 1):
        raise ValueError(
            f"KernelConfig.{field} must be a power of two >= 16, got {value}")
    for field in ("num_warps", "num_warps_bwd"):
      value = getattr(self, field)
      if value is not None and (type(value) is not int or value not in _WARPS):
        raise ValueError(f"KernelConfig.{field} must be one of {_WARPS} or None (tuned), "
                         f"got {value!r}")
    for field in ("num_stages", "num_stages_bwd"):
      value = getattr(self, field)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 1):
        raise ValueError(f"KernelConfig.{field} must be an int >= 1 or None (tuned), "
                         f"got {value!r}")
    if self.kv_splits is not None and (isinstance(self.kv_splits, bool)
                                       or not isinstance(self.kv_splits, int)
                                       or self.kv_splits < 1):
      raise ValueError(f"KernelConfig.kv_splits must be an int >= 1 or None (tuned), "
                       f"got {self.kv_splits!r}")
    if self.pack_gqa is not None and not isinstance(self.pack_gqa, bool):
      raise TypeError(f"KernelConfig.pack_gqa must be a bool or None (tuned), "
                      f"got {self.pack_gqa!r}")
    if self.interpret is not None and not isinstance(self.interpret, bool):
      raise TypeError(
          f"KernelConfig.interpret must be a bool or None, got {self.interpret!r}")
    if self.backend not in BACKENDS:
      raise ValueError(f"KernelConfig.backend must be one of {BACKENDS}, got {self.backend!r}")
    if not isinstance(self.mosaic, MosaicTiles):
      raise TypeError(f"KernelConfig.mosaic must be a MosaicTiles, got {self.mosaic!r}")

  def unset(self) -> tuple[str, ...]:
    """The fields left to the tuned table, ``mosaic``'s as ``mosaic.<name>``
    (``interpret=None`` is a choice of its own, not a tuned value)."""
    return unset_fields(self) + tuple(f"mosaic.{name}" for name in self.mosaic.unset())

  def require_filled(self, where: str):
    require_filled(self, where)

  def filled(self, tuned: KernelConfig) -> KernelConfig:
    """This config with every unset tile, warp and stage field, ``mosaic``'s
    included, taken from ``tuned``; ``backend`` and ``interpret`` stay."""
    return dataclasses.replace(
        self, mosaic=self.mosaic.filled(tuned.mosaic),
        **{name: getattr(tuned, name) for name in unset_fields(self)})
