"""Mosaic GPU's tuned table (16-bit only), from ``python -m benchmarks.tune
--backend mosaic``, candidates timed round-robin on the H200 (docs/BENCHMARKS.md,
"Tiles")."""

from __future__ import annotations

from ua_reference.contract import StaticSpec

from .config import MosaicTiles

# The longest sequence whose full forward the table runs persistent (mosaic_tiles):
# it gained at 1k and 4k and not at 16k (docs/BENCHMARKS.md); between them is unmeasured.
PERSISTENT_MAX_SEQ_LEN = 4096


def mosaic_tiles(spec: StaticSpec, dtype) -> MosaicTiles:
  """Every MosaicTiles field of the table: forward key tiles of 128 up to head
  dim 128, else 64 (two stages of K and V at head dim 256 fit the shared memory
  only so); 128-key dq tiles beat 64 at head dim 128. The forward
  is persistent without a causal mask or a window, up to PERSISTENT_MAX_SEQ_LEN
  keys: what it saves is one prologue and epilogue per item, which matters
  where items are short (docs/HISTORY.md, "The persistent forward"). Under
  a causal mask or a window the items' work follows the query tile, and dealt
  round-robin they leave multiprocessors idle at the end; packed documents'
  items, whose work follows the documents, gained from it even where one row
  is one document and the others 32 short ones (docs/BENCHMARKS.md, "Packed
  documents: the persistent forward").
  Above head dim 64 the forward overlaps each tile's softmax with the
  previous tile's P @ V, which gained at head dims 128 and 256 and lost at 64
  (docs/HISTORY.md, "The overlapped forward"). The deterministic backward
  stays the separate dq and dk/dv kernels until the ordered fused one has been
  timed against them (`bench --impls 'ua_kernels,ua_kernels[ordered]'`)."""
  del dtype  # measured in bfloat16; float16 has the same bytes
  banded = spec.causal or bool(spec.window_len)
  return MosaicTiles(block_q=64, block_kv=128 if spec.head_dim <= 128 else 64, stages=2,
                     block_q_dq=64, block_kv_dq=128, block_q_dkv=64, block_kv_dkv=64,
                     stages_bwd=2,
                     persistent=not banded and spec.seq_len <= PERSISTENT_MAX_SEQ_LEN,
                     overlap_softmax=spec.head_dim > 64, ordered_fused=False)
