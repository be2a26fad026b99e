"""Tile sizes and launch parameters of the kernels.

Every tile and launch field defaults to None, "the tuned table's value": the
backend is chosen apart from the tiles, so forcing one (``backend="triton"``)
or setting a few fields keeps the tuned tiles of everything else. A call's
effective config, every None filled for its shape, dtype and backend, comes
from ua_kernels.tuned_configs.effective_config (KernelConfig.filled below).
"""

from __future__ import annotations

import dataclasses

_WARPS = (1, 2, 4, 8, 16)
BACKENDS = ("auto", "triton", "mosaic")


def _unset(config) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(config) if getattr(config, f.name) is None
               and f.name != "interpret")


def _require_filled(config, where: str):
  """Kernels and launch code take effective configs only: an unset field there
  is a caller that skipped tuned_configs.effective_config, not a tuning choice,
  and would otherwise fail as arithmetic on None deep in a trace."""
  if unset := config.unset():
    raise ValueError(f"{where} needs a filled {type(config).__name__} "
                     f"(ua_kernels.tuned_configs.effective_config); unset: {', '.join(unset)}")


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
  """Tiles of the Mosaic GPU kernels, whose programs each have two compute
  warpgroups; None (every field's default) takes the tuned table's value
  (tuned_configs.mosaic_tiles). Forward: ``block_q`` query rows per compute
  warpgroup (a program owns two such blocks); ``block_kv`` keys per streamed
  tile; ``stages``: slots of the K/V ring. Backward: the dq kernel owns
  ``block_q_dq`` query rows per warpgroup and streams ``block_kv_dq`` keys;
  the dk/dv kernel owns ``block_kv_dkv`` keys per warpgroup and streams
  ``block_q_dkv`` queries; both with rings of ``stages_bwd`` slots.
  ``persistent``: the forward runs one program per multiprocessor, each
  taking work items in turn, so that its K/V ring streams on from one item
  into the next and the next item's Q arrives during this one's epilogue.
  ``overlap_softmax``: each compute warpgroup issues a key tile's Q K^T with
  the previous tile's P @ V and computes the softmax while that product runs
  (FlashAttention-3's intra-warpgroup overlap), in place of the schedule
  barrier that alternates the two compute warpgroups (with both it was
  slower: docs/BENCHMARKS.md, "The overlapped forward"); the same bits as
  without. Above head
  dim 128 the dq kernel streams at most 64 keys, and backward tiles whose
  shared memory does not fit run the backward on Triton
  (mosaic_backward.halves_shared_memory)."""

  block_q: int | None = None
  block_kv: int | None = None
  stages: int | None = None
  block_q_dq: int | None = None
  block_kv_dq: int | None = None
  block_q_dkv: int | None = None
  block_kv_dkv: int | None = None
  stages_bwd: int | None = None
  persistent: bool | None = None
  overlap_softmax: bool | None = None

  def __post_init__(self):
    for name in ("persistent", "overlap_softmax"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, bool):
        raise ValueError(f"MosaicTiles.{name} must be a bool or None (tuned), got {value!r}")
    for name, allowed in (("block_q", (64, 128)), ("block_kv", (64, 128, 256)),
                          ("block_q_dq", (64, 128)), ("block_kv_dq", (64, 128)),
                          ("block_q_dkv", (64, 128)), ("block_kv_dkv", (64, 128))):
      value = getattr(self, name)
      if value is not None and (type(value) is not int or value not in allowed):
        raise ValueError(f"MosaicTiles.{name} must be one of {allowed} (wgmma tiles) or None "
                         f"(tuned), got {value!r}")
    for name in ("stages", "stages_bwd"):
      value = getattr(self, name)
      if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                or value < 2):
        raise ValueError(f"MosaicTiles.{name} must be an int >= 2 or None (tuned), "
                         f"got {value!r}")

  def unset(self) -> tuple[str, ...]:
    """The fields left to the tuned table."""
    return _unset(self)

  def require_filled(self, where: str):
    _require_filled(self, where)

  def filled(self, tuned: MosaicTiles) -> MosaicTiles:
    """These tiles with every unset field taken from ``tuned``."""
    return dataclasses.replace(self, **{name: getattr(tuned, name) for name in self.unset()})


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
  (ua_kernels.mosaic_forward; attention.forward_backend), and Pallas-Triton
  elsewhere; "triton" and "mosaic" force one (forcing Mosaic for a call it
  cannot run is an error).
  The backward runs on the forward's backend where that backend's backward
  supports the call (ua_kernels.mosaic_backward), else on Pallas-Triton.
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
    return _unset(self) + tuple(f"mosaic.{name}" for name in self.mosaic.unset())

  def require_filled(self, where: str):
    _require_filled(self, where)

  def filled(self, tuned: KernelConfig) -> KernelConfig:
    """This config with every unset tile, warp and stage field, ``mosaic``'s
    included, taken from ``tuned``; ``backend`` and ``interpret`` stay."""
    return dataclasses.replace(
        self, mosaic=self.mosaic.filled(tuned.mosaic),
        **{name: getattr(tuned, name) for name in _unset(self)})
