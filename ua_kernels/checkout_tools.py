"""``ua-bench`` and ``ua-mutate``: launchers of the benchmark harness and the
mutation tool. Both live in a source checkout's benchmarks/, not in the
installed package: they time and mutate this repository's kernels, and the
harness adapts the suite's peers (docs/BENCHMARKS.md, docs/MUTATION.md)."""

from __future__ import annotations

import importlib
import pathlib
import sys


def _run(module: str, command: str):
  root = pathlib.Path.cwd()
  if not (root / "benchmarks" / "__init__.py").is_file():
    raise SystemExit(f"{command}: run it in a source checkout of unified-attention (no "
                     f"benchmarks/ package in {root}); it is python -m {module} there")
  sys.path.insert(0, str(root))
  return importlib.import_module(module).main()


def bench_main():
  return _run("benchmarks.bench", "ua-bench")


def mutate_main():
  return _run("benchmarks.mutation", "ua-mutate")
