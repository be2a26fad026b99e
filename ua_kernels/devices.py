"""What both backends ask of the GPU they run on."""

from __future__ import annotations

import jax

# Streaming multiprocessors of an H100 or H200 SXM.
HOPPER_MULTIPROCESSORS = 132


def multiprocessors() -> int:
  """Streaming multiprocessors of the first GPU jax sees, for a persistent
  kernel's program count or a decode call's key splits; 132 (an H100 or H200
  SXM) where none is present (the kernels lower for CUDA, or run in the
  interpreter, on a machine without one)."""
  for device in jax.devices():
    if device.platform == "gpu" and getattr(device, "core_count", 0):
      return int(device.core_count)
  return HOPPER_MULTIPROCESSORS
