"""Whether a change leaves the single-device call's program as it was.

``python -m benchmarks.same_lowering --base REV`` lowers the forward and
backward of ``ua_kernels.attention`` (jit of its gradient, lse included) for a
few configurations, with REV's ua_kernels (imported beside the working tree's,
benchmarks/ab.py) and with the working tree's, and compares the text. On a
machine without a GPU the kernels lower through the Pallas interpreter, whose
program holds every kernel body's operations: identical text means the call
traces the same kernels, so a change that adds a path (a keyword left at its
default) costs that call nothing. Exits 1 if any configuration differs.

With ``--mosaic`` it compares the Mosaic GPU kernels instead: the call lowered
for CUDA with ``backend="mosaic"`` (no GPU needed), each kernel's module taken
out of its custom call and printed without source locations (which name files
and lines, so they differ with any edit). A module may also be "reordered":
the same operations, SSA names aside, in another order, as when a change only
moves where the program reads its grid position.
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from benchmarks.ab import import_revision

CONFIGS = (
    ("bfloat16", {}),
    ("bfloat16", {"causal": True}),
    ("float32", {"window_len": 9, "segments": True}),
    ("float16", {"causal": True, "cap_method": "tanh", "cap_params": (5.0,),
                 "z_loss_weight": 0.1}),
    ("float32", {"causal": True, "window_len": 17}),
)


def lowered_text(module, dtype, options, t=48) -> str:
  rng = np.random.default_rng(0)
  options = dict(options)
  q = jnp.asarray(rng.standard_normal((1, t, 4, 32)), dtype)
  k = jnp.asarray(rng.standard_normal((1, t, 2, 32)), dtype)
  seg = jnp.asarray((np.arange(t) // 10)[None], jnp.int32) if options.pop("segments", False) \
      else None

  def loss(q, k, v):
    out, lse = module.attention(q, k, v, segment_ids=seg, return_lse=True, **options)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, k).as_text()
  return text.replace(module.__name__, "ua_kernels")


# (T, head dim, causal) of bfloat16 calls at 16k tokens, 16 heads: the per-item
# and persistent forwards (mosaic.tuned.mosaic_tiles) and both backward forms.
MOSAIC_CONFIGS = ((1024, 64, True), (1024, 256, True), (4096, 128, False),
                  (16384, 128, False), (16384, 256, True))

_MODULE = re.compile(r'module = "((?:[^"\\]|\\.)*)"')


def _unescape(text: str) -> bytes:
  """The bytes of an MLIR string attribute's body (escapes \\XX, \\\\ and \\")."""
  out, i = bytearray(), 0
  while i < len(text):
    if text[i] != "\\":
      out += text[i].encode()
      i += 1
    elif text[i + 1] in '\\"':
      out.append(ord(text[i + 1]))
      i += 2
    else:
      out.append(int(text[i + 1:i + 3], 16))
      i += 3
  return bytes(out)


# jax 0.11 names each lowered kernel's dump file with a process-wide counter
# ("ua_forward_mosaic_3"): the same kernel lowered later in one process differs there only.
_DUMP_COUNTER = re.compile(r'(mosaic_gpu\.dump_basename = "[^"]*?)_\d+"')


def mosaic_modules(lowered: str) -> list[str]:
  """Each Mosaic GPU kernel's module in a lowered program's text, printed
  without locations and without the dump file's counter."""
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  from jax.experimental.mosaic.gpu import dialect as mosaic_gpu_dialect
  context = jax_mlir.make_ir_context()
  mosaic_gpu_dialect.register_dialect(context)
  context.allow_unregistered_dialects = True
  with context:
    return [_DUMP_COUNTER.sub(r'\1"', ir.Module.parse(_unescape(body)).operation.get_asm(
        enable_debug_info=False)) for body in _MODULE.findall(lowered)]


def _operations(module_text: str) -> list[str]:
  """The module's lines with SSA value and block names erased, sorted."""
  return sorted(re.sub(r"\^bb\d+", "^bb", re.sub(r"%\d+(#\d+)?", "%", line))
                for line in module_text.splitlines())


def mosaic_lowered_text(module, t, d, causal) -> str:
  x = jax.ShapeDtypeStruct((16384 // t, t, 16, d), jnp.bfloat16)
  config = module.KernelConfig(backend="mosaic", interpret=False)

  def loss(q, k, v):
    out = module.attention(q, k, v, causal=causal, config=config)
    return jnp.sum(out.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower(
      lowering_platforms=("cuda",)).as_text(debug_info=False)


def _kernel_name(module_text: str) -> str:
  found = re.search(r"ua_\w+?_mosaic", module_text)
  return found.group(0) if found else "kernel"


def compare_mosaic(base: list[str], new: list[str]) -> dict[str, str]:
  """Each kernel's verdict: "identical", "reordered" (the same operations in
  another order) or "DIFFERENT"; a kernel present in one program only is
  "DIFFERENT"."""
  names = [_kernel_name(m) for m in new]
  if [_kernel_name(m) for m in base] != names:
    return {"kernels": "DIFFERENT"}
  return {name: "identical" if a == b else
          "reordered" if _operations(a) == _operations(b) else "DIFFERENT"
          for name, a, b in zip(names, base, new)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.same_lowering",
                                   description=__doc__)
  parser.add_argument("--base", required=True, help="git revision to compare against")
  parser.add_argument("--mosaic", action="store_true",
                      help="compare the Mosaic GPU kernels lowered for CUDA (MOSAIC_CONFIGS)")
  options = parser.parse_args(argv)
  base = import_revision(options.base, "ua_kernels_base")
  differ = 0
  if options.mosaic:
    for t, d, causal in MOSAIC_CONFIGS:
      modules = [mosaic_modules(mosaic_lowered_text(m, t, d, causal)) for m in (base, ua_kernels)]
      verdicts = compare_mosaic(*modules)
      differ += "DIFFERENT" in verdicts.values()
      print(f"T={t} D={d} {'causal' if causal else 'full'}: "
            + ", ".join(f"{name} {verdict}" for name, verdict in verdicts.items()), flush=True)
    return 1 if differ else 0
  for dtype, config in CONFIGS:
    same = lowered_text(base, jnp.dtype(dtype), config) == lowered_text(
        ua_kernels, jnp.dtype(dtype), config)
    differ += not same
    print(f"{dtype} {config}: {'identical' if same else 'DIFFERENT'}", flush=True)
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
