"""The Pallas Mosaic GPU backend, Hopper only (wgmma, TMA), 16-bit inputs and
head dims up to 256. forward (its launch code and kernels), backward (its launch
code; the kernels in dq and dkv, what they share in backward_parts),
common (what both share: rings, tile logits, launch helpers), config
(MosaicTiles), tuned (its table)."""
