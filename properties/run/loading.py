"""What the plugin and the CLIs share before anything heavy is imported: the
default implementation and the modules named by --import / --ua-import (they
register cap methods). The standard library only: the plugin imports this in
every pytest session of the environment."""

from __future__ import annotations

import importlib

DEFAULT_IMPL = "ua_kernels:attention"


def import_modules(names: str | None, load: bool = True) -> tuple[str, ...]:
  """The comma-separated module names of ``names``, imported unless ``load`` is False."""
  modules = tuple(n.strip() for n in (names or "").split(",") if n.strip())
  if load:
    for name in modules:
      importlib.import_module(name)
  return modules
