"""Zero padding of the kernels' inputs to their tile multiples, shared by both backends."""

from __future__ import annotations

import jax.numpy as jnp


def pad(x, axis_sizes: dict[int, int]):
  """``x`` zero-padded at the end of each axis to its size in ``axis_sizes``
  (unchanged when nothing needs padding)."""
  pads = [(0, 0)] * x.ndim
  for axis, size in axis_sizes.items():
    pads[axis] = (0, size - x.shape[axis])
  if all(p == (0, 0) for p in pads):
    return x
  return jnp.pad(x, pads)
