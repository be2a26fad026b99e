"""The Pallas and Mosaic GPU calls whose API differs across the supported jax
releases (pyproject's range), each chosen by testing the API itself, never a
version string, so that a release that back- or forward-ports a change is
served by what it has.

What changed between jax 0.10.2, 0.11.2 and 0.12.0.1 that these kernels use,
and what replaced it:

- ``plgpu.load(src, idx, *, layout, optimized)``: 0.10 requires ``idx`` (the
  kernels pass ``()``, the whole ref); 0.11 makes it optional and deprecates
  it; 0.12 removes it, and a ref is indexed before the load (``ref.at[...]``),
  which is how the kernels already pass their slices. :func:`load_vector`.
- ``jnp.log2`` inside a Mosaic GPU kernel: 0.10 has no lowering for it
  (fast_math.log2 takes ``log(x) * log2(e)`` on that backend on every release,
  one rounding more, so that the kernels' numerics do not depend on the jax
  release).
- The Pallas-Triton backend: 0.12 deprecates it (a DeprecationWarning when a
  kernel lowers) and still lowers and runs it, unchanged; float32 and GPUs
  other than Hopper depend on it (ua_kernels.attention's dispatch).
- Mosaic GPU's interpreter (``plgpu.InterpretGPUParams``) exists from 0.11 on:
  tests/test_mosaic_interpret.py skips without it.

Every other Pallas call of the kernels (``plgpu.kernel``, ``copy_gmem_to_smem``,
``barrier_wait``/``barrier_arrive``, ``wgmma``, ``ACC``, ``SMEM``, ``Barrier``,
``layout_cast``, ``CompilerParams(lowering_semantics=...)``, ``pl.run_state``,
``pl.run_scoped``, ``pl.loop``, Pallas-Triton's ``pallas_call``) has one
signature across the range; tests/test_mosaic.py lowers every kernel under
each release CI installs (.ci/run), which is what would show a new difference.
"""

from __future__ import annotations

import functools
import inspect


def plgpu():
  """jax.experimental.pallas.mosaic_gpu, imported when first used: Mosaic GPU's
  Python modules load MLIR bindings (and, under jax 0.10, absl), which nothing
  else of the package needs."""
  from jax.experimental.pallas import mosaic_gpu
  return mosaic_gpu


@functools.cache
def _load_needs_index() -> bool:
  """Whether plgpu.load requires its positional ``idx`` (0.10). 0.11 makes it
  optional and deprecated, 0.12 removes it: from 0.11 on the ref, already
  sliced with ``.at``, is passed alone, as the kernels ran on 0.11.2 before."""
  parameter = inspect.signature(plgpu().load).parameters.get("idx")
  return parameter is not None and parameter.default is inspect.Parameter.empty


def load_vector(ref, layout):
  """plgpu.load of a whole 1-D ref (already sliced with ``.at``) in
  ``layout``, not requiring an optimized (vectorised) load: the per-row
  vectors of a tile are read once per tile."""
  if _load_needs_index():
    return plgpu().load(ref, (), layout=layout, optimized=False)
  return plgpu().load(ref, layout=layout, optimized=False)
