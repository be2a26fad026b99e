"""The Pallas Mosaic GPU backend, Hopper only (wgmma, TMA), 16-bit inputs and
head dims up to 256. forward and backward (each its launch code and kernels),
common (what both share: rings, tile logits, launch helpers), config
(MosaicTiles), tuned (its table)."""
