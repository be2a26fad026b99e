"""Two revisions of ua_kernels timed in one process: a kernel change's cost.

``python -m benchmarks.ab --base REV`` extracts REV's ua_kernels with
``git archive``, imports it beside the working tree's as another package, and
times both on the same configurations with bench.time_interleaved (round-robin,
so drift moves both alike): forward and forward+backward, milliseconds and the
ratio new/base. Separate processes would put their runs minutes apart.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import io
import json
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import jax.numpy as jnp
import numpy as np

import ua_kernels
from benchmarks.bench import fwd_and_grad_times, provenance

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# (label, B, T, Hq, Hkv, D, causal, tanh cap or 0, z-loss weight): the headline
# shape, plain, causal, capped (the cap is where a change to the softmax step
# shows most) and with a z-loss (which changes the backward's rounding of ds);
# causal at T = 16k, where a query tile's work spans 1 to 128 key tiles (the
# grid's order shows most).
CASES = (
    ("full", 4, 4096, 16, 16, 128, False, 0.0, 0.0),
    ("causal", 4, 4096, 16, 16, 128, True, 0.0, 0.0),
    ("causal T16k", 1, 16384, 16, 16, 128, True, 0.0, 0.0),
    ("full tanh cap 30", 4, 4096, 16, 16, 128, False, 30.0, 0.0),
    ("causal tanh cap 30", 4, 4096, 16, 16, 128, True, 30.0, 0.0),
    ("full z-loss 1e-4", 4, 4096, 16, 16, 128, False, 0.0, 1e-4),
    ("causal z-loss 1e-4", 4, 4096, 16, 16, 128, True, 0.0, 1e-4),
)


def import_revision(rev: str, name: str):
  """REV's ua_kernels package, imported as ``name`` (its imports are relative);
  REV may also be a directory holding a ua_kernels package (a tree whose
  commit the machine's clone lacks)."""
  if pathlib.Path(rev).is_dir():
    root = pathlib.Path(rev)
  else:
    archive = subprocess.run(["git", "archive", rev, "ua_kernels"], cwd=_ROOT, check=True,
                             capture_output=True).stdout
    root = pathlib.Path(tempfile.mkdtemp(prefix=f"ab-{rev}-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
      tar.extractall(root, filter="data")
  package = root / "ua_kernels"
  if not (package / "__init__.py").is_file():
    raise SystemExit(f"--base {rev}: no ua_kernels package there")
  spec = importlib.util.spec_from_file_location(
      name, package / "__init__.py", submodule_search_locations=[str(package)])
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__)
  parser.add_argument("--base", required=True,
                      help="git revision, or a directory holding ua_kernels, to compare against")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--json", default="ab.json")
  parser.add_argument("--case", action="append", choices=[c[0] for c in CASES],
                      help="time only this case (repeatable; default: all)")
  options = parser.parse_args(argv)
  if options.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {options.repeats}")
  base = import_revision(options.base, "ua_kernels_base")
  result = {**provenance(argv), "base": options.base, "rows": []}
  dtype = jnp.dtype(options.dtype)
  for label, b, t, hq, hkv, d, causal, cap, z_loss in CASES:
    if options.case and label not in options.case:
      continue
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), dtype) for h in (hq, hkv, hkv))
    kw = dict(causal=causal, cap_method="tanh" if cap else "none",
              cap_params=(cap,) if cap else (), z_loss_weight=z_loss)
    fns = {"new": functools.partial(ua_kernels.attention, **kw),
           "base": functools.partial(base.attention, **kw)}
    row = {"case": f"B{b} T{t} H{hq}/{hkv} D{d} {options.dtype} {label}",
           **fwd_and_grad_times(fns, (q, k, v), options.repeats, base="base")}
    print(json.dumps(row), flush=True)
    result["rows"].append(row)
  pathlib.Path(options.json).write_text(json.dumps(result, indent=1) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
