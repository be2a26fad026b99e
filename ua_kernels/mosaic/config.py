"""The Mosaic GPU kernels' tiles (MosaicTiles, KernelConfig.mosaic), and the
convention both backends' configs share: a field left None is the tuned
table's value, filled per call (ua_kernels.tuned_configs.effective_config)."""

from __future__ import annotations

import dataclasses


def unset_fields(config) -> tuple[str, ...]:
  """The fields of a config dataclass left to the tuned table (``interpret``,
  KernelConfig's, is a choice of its own)."""
  return tuple(f.name for f in dataclasses.fields(config) if getattr(config, f.name) is None
               and f.name != "interpret")


def require_filled(config, where: str):
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
  (ua_kernels.mosaic.tuned). Forward: ``block_q`` query rows per compute
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
  slower: docs/HISTORY.md, "The overlapped forward"); the same bits as
  without. ``ordered_fused``: the deterministic backward (``deterministic=True``)
  runs as the fused kernel, each dq tile's shares added in the order of their
  key tiles (a counter per tile, FlashAttention-3's deterministic mode), where
  the fused kernel runs; else as the separate dq and dk/dv kernels. Above head
  dim 128 the dq kernel streams at most 64 keys, and backward tiles whose
  shared memory does not fit run the backward on Triton
  (backward.halves_shared_memory)."""

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
  ordered_fused: bool | None = None

  def __post_init__(self):
    for name in ("persistent", "overlap_softmax", "ordered_fused"):
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
    return unset_fields(self)

  def require_filled(self, where: str):
    require_filled(self, where)

  def filled(self, tuned: MosaicTiles) -> MosaicTiles:
    """These tiles with every unset field taken from ``tuned``."""
    return dataclasses.replace(self, **{name: getattr(tuned, name) for name in self.unset()})
