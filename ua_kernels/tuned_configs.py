"""A call's effective config: the fields it sets as given, the others from the
backends' tuned tables (ua_kernels.triton.tuned, ua_kernels.mosaic.tuned),
whichever backend it picks, so that choosing a backend or a few tiles keeps the
tuning of the rest."""

from __future__ import annotations

import dataclasses

from ua_reference.contract import StaticSpec

from .kernel_config import KernelConfig
from .mosaic.tuned import mosaic_tiles
from .triton.tuned import triton_config


def default_config(spec: StaticSpec, dtype) -> KernelConfig:
  """The table's config for a call, every field filled, backend "auto"."""
  return dataclasses.replace(triton_config(spec, dtype), mosaic=mosaic_tiles(spec, dtype))


def effective_config(spec: StaticSpec, dtype, config: KernelConfig | None = None
                     ) -> KernelConfig:
  """The config a call runs with: ``config``'s set fields as given, its unset
  (None) ones from the table for this spec and dtype, whichever backend it
  picks, so that choosing a backend or a few tiles keeps the tuning of the rest.
  Idempotent; None is the table's config."""
  if config is None:
    return default_config(spec, dtype)
  if not isinstance(config, KernelConfig):
    raise TypeError(f"config must be a KernelConfig or None, got {type(config).__name__}")
  if not config.unset():
    return config
  return config.filled(default_config(spec, dtype))
