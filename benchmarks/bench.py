"""python -m benchmarks.bench (ua-bench): forward and forward+backward time and TFLOP/s against peers.

FLOPs: 4*B*Hq*T^2*D for the forward over visible pairs (halved for causal,
T*W-ish for windows: counted exactly from the mask), forward+backward 3.5x.
Timing: median over --repeats rounds that time every implementation of a
configuration in turn (time_interleaved), after warm-up; block_until_ready.
Each peer runs at its best-known configuration (PEER_CONFIGS), ours at its
tuned defaults (ua_kernels/triton/tuned.py, mosaic/tuned.py). Prints a table headed by date,
GPU, commit and versions, and writes it as JSON: provenance() fields, then
"rows", each with its case, implementation and that implementation's "config".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.metadata
import importlib.util
import json
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from properties.peers.impls import PALLAS_MHA_TILES
from ua_kernels import KernelConfig, MosaicTiles
from ua_kernels.attention import backends_for
from ua_kernels.backends import triton_attention
from ua_kernels.tuned_configs import default_config
from ua_reference.contract import validate

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# Each peer at its best-known configuration, written into its rows' "config".
# JAX's Pallas-Triton mha at the tiles of properties/peers/impls.py PALLAS_MHA_TILES
# (block_q 128, block_k 64, every backward block 64; num_warps and num_stages
# left to mha): on the H200 about 323 TFLOP/s forward+backward, against 146 at
# mha's default block sizes (docs/HISTORY.md, "Against the peers"). cuDNN
# and XLA through jax.nn.dot_product_attention have no tiles to set; the jnp
# peer is plain XLA; FlexAttention runs with torch.compile's default options.
PEER_CONFIGS = {
    "jax_pallas_triton": {"block_sizes": dict(PALLAS_MHA_TILES)},
    "jax.nn.dpa[cudnn]": {"implementation": "cudnn", "tiles": None},
    "jax.nn.dpa[xla]": {"implementation": "xla", "tiles": None},
    "jnp_tanh_cap": {"implementation": "jnp einsum + softmax under XLA", "tiles": None},
    "torch_flex": {"implementation": "torch.compile(flex_attention)", "kernel_options": None},
}
PEER_CONFIGS["jax_pallas_triton_nocap"] = PEER_CONFIGS["jax_pallas_triton"]
PEER_CONFIGS["torch_flex_tanh"] = PEER_CONFIGS["torch_flex"]
# tokamax's Mosaic GPU kernel (properties/peers/impls_tokamax.py), where it is
# installed (docs/PEERS.md says how): at its own choice of config (on an H200
# its heuristics: its autotuning cache is keyed by device kind and holds the
# H100 only) and at the configs that cache records as the H100's fastest.
PEER_CONFIGS["tokamax"] = {"implementation": "tokamax 0.0.17 Mosaic GPU (sm90)",
                           "config": "tokamax's own (heuristics on an H200)"}
PEER_CONFIGS["tokamax[h100_best]"] = {"implementation": PEER_CONFIGS["tokamax"]["implementation"],
                                      "config": "impls_tokamax.h100_best_config"}


def _git_commit():
  """The commit measured: the content of a .commit file at the repository root
  when one is there (written beside a copy of the tree sent to a machine whose
  git directory may be stale or absent), else git's HEAD, with ``+dirty`` where
  tracked files differ from it (such a run measured no commit), else "unknown"."""
  try:
    recorded = (_ROOT / ".commit").read_text().strip()
    if recorded:
      return recorded
  except OSError:
    pass
  git = lambda *args: subprocess.run(["git", "-C", str(_ROOT), *args], check=True,
                                     capture_output=True, text=True, timeout=10).stdout.strip()
  try:
    head = git("rev-parse", "HEAD")
  except Exception:  # noqa: BLE001 -- no git, or no repository (a copied tree)
    return "unknown"
  try:
    changed = git("status", "--porcelain", "--untracked-files=no")
  except Exception:  # noqa: BLE001 -- HEAD known, the tree's state not: not HEAD's alone
    changed = "unknown"
  return head + ("+dirty" if changed else "")


def provenance(argv=None):
  """The header of a result file (ua-bench, benchmarks/tune.py): commit, the
  command line (sys.argv; ``argv`` in place of its arguments when main() was
  called with them), versions, GPU and UTC date and time."""
  versions = {"python": platform.python_version(), "jax": jax.__version__}
  for name in ("jaxlib", "triton", "torch"):
    if importlib.util.find_spec(name) is None:
      continue
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = getattr(__import__(name), "__version__", "unknown")
  args = sys.argv[1:] if argv is None else list(argv)
  return {"commit": _git_commit(), "command": shlex.join([sys.argv[0], *args]),
          "gpu": jax.devices()[0].device_kind, "versions": versions,
          "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def visible_pairs(t, causal, window, doc_len=None):
  """Exact count of visible (query, key) pairs for one head."""
  if doc_len:
    n = t // doc_len
    return n * visible_pairs(doc_len, causal, window)
  i = np.arange(t)
  lo = np.maximum(i - window + 1, 0) if window else np.zeros_like(i)
  hi = i + 1 if causal else np.full_like(i, t)
  return int(np.maximum(hi - lo, 0).sum())


def time_interleaved(fns, args, repeats, inner=5):
  """{name: median ms per call} for jitted ``fns``, timed round-robin: each round
  times every function once (``inner`` calls, block_until_ready), so clock or
  thermal drift during the run moves all of them alike and their ratios hold.
  Two warm-up calls each first; a function that fails there maps to its exception.
  """
  live, out = {}, {}
  for name, fn in fns.items():
    try:
      jax.block_until_ready(fn(*args))
      jax.block_until_ready(fn(*args))
      live[name] = fn
    except Exception as exc:  # noqa: BLE001 -- e.g. a peer without this feature
      out[name] = exc
  times = {name: [] for name in live}
  for _ in range(repeats):
    for name, fn in live.items():
      start = time.perf_counter()
      for _ in range(inner):
        result = fn(*args)
      jax.block_until_ready(result)
      times[name].append((time.perf_counter() - start) / inner * 1e3)
  out.update({name: statistics.median(ts) for name, ts in times.items()})
  return out


def _fwd_bwd(f):
  """jit(grad) of f's output sum with respect to q, k and v (further arguments,
  segment ids or temperature, get none)."""
  def loss(q, k, v, *rest):
    return jnp.sum(f(q, k, v, *rest).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def _temp_mib(fn, args):
  """The device memory (MiB) jitted ``fn`` takes beside its arguments and
  outputs (XLA's memory analysis of its compiled program: the fused backward's
  float32 dq, a peer's workspace), or None where the backend gives none."""
  try:
    analysis = fn.lower(*args).compile().memory_analysis()
  except Exception:  # noqa: BLE001 -- a peer that failed to compile is reported by its time
    return None
  return None if analysis is None else analysis.temp_size_in_bytes / 2 ** 20


def fwd_and_grad_times(fns, args, repeats, base):
  """{"fwd": ..., "fwd_bwd": ...} of jit(f) and _fwd_bwd(f) for each of ``fns``,
  timed round-robin (time_interleaved): milliseconds (a failure's repr), and
  "NAME/BASE", each function's time over ``base``'s, where both ran."""
  row = {}
  for what, wrap in (("fwd", jax.jit), ("fwd_bwd", _fwd_bwd)):
    ms = time_interleaved({n: wrap(f) for n, f in fns.items()}, args, repeats)
    row[what] = {n: (x if isinstance(x, float) else repr(x)) for n, x in ms.items()}
    for n in fns:
      if n != base and isinstance(ms.get(n), float) and isinstance(ms.get(base), float):
        row[what][f"{n}/{base}"] = ms[n] / ms[base]
  return row


def _with_runtime_options(attention, q, k, v, segment_ids=None, temperature=None, **static):
  """``attention`` with segment ids and temperature as arguments of the jitted
  call, as in training (bound as constants, XLA would precompute what the
  kernels derive from them, the segment spans, at compile time)."""
  return attention(q, k, v, segment_ids=segment_ids, temperature=temperature, **static)


def peers(causal, window, cap, doc_len, hq, hkv):
  """name -> attention(q, k, v) for the peers that support this configuration."""
  out = {}
  plain = not window and not doc_len
  if plain and hq == hkv:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    # In a capped configuration this is JAX's kernel without the cap, the
    # reference for the cap's cost: timed round-robin beside ours, not in
    # another group, whose neighbours and clocks differ.
    block_sizes = pallas_attention.BlockSizes(**PALLAS_MHA_TILES)
    out["jax_pallas_triton" + ("_nocap" if cap else "")] = lambda q, k, v: pallas_attention.mha(
        q, k, v, segment_ids=None, causal=causal, sm_scale=q.shape[-1] ** -0.5,
        block_sizes=block_sizes)
  if not cap and plain:
    for impl in ("cudnn", "xla"):
      out[f"jax.nn.dpa[{impl}]"] = functools.partial(
          lambda q, k, v, impl: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation=impl), impl=impl)
  if cap and plain and hq == hkv:
    def jnp_cap(q, k, v):
      s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
      s = s * q.shape[-1] ** -0.5
      s = cap * jnp.tanh(s / cap)
      if causal:
        t = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
      p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
      return jnp.einsum("bhqk,bkhd->bqhd", p, v)
    out["jnp_tanh_cap"] = jnp_cap
  if plain:
    out.update(tokamax_peers(causal, cap))
  return out


def tokamax_peers(causal, cap) -> dict:
  """name -> attention(q, k, v) of tokamax at its PEER_CONFIGS, or none where
  tokamax is not installed."""
  try:
    from properties.peers import impls_tokamax
    impls_tokamax.install_xprof_stub()
    import tokamax  # noqa: F401
  except ImportError:
    return {}
  kw = dict(causal=causal, cap_method="tanh" if cap else "none", cap_params=(cap,) if cap else ())
  return {"tokamax": functools.partial(impls_tokamax.tokamax_attention, **kw),
          "tokamax[h100_best]": functools.partial(impls_tokamax.tokamax_attention,
                                                  config="h100_best", **kw)}


def torch_flex(b, t, h, d, causal, cap, repeats, dtype="bfloat16"):
  """(fwd ms, fwd+bwd ms) of torch FlexAttention with a tanh score_mod, or None."""
  try:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    import triton.testing
  except Exception:  # noqa: BLE001 -- optional peer
    return None
  if not torch.cuda.is_available():
    return None
  q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=getattr(torch, dtype), requires_grad=True)
             for _ in range(3))
  score_mod = (lambda s, b_, h_, qi, ki: cap * torch.tanh(s / cap)) if cap else None
  mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, t, t) if causal else None
  flex = torch.compile(flex_attention)
  fwd = lambda: flex(q, k, v, score_mod=score_mod, block_mask=mask)
  def fwd_bwd():
    fwd().sum().backward()
  return (triton.testing.do_bench(fwd, return_mode="median"),
          triton.testing.do_bench(fwd_bwd, return_mode="median"))


CONFIGS = {
    # name: (B, T, Hq, Hkv, D, causal, window, tanh cap, doc_len)
    "quick": [(4, 4096, 16, 16, 128, False, 0, 0.0, 0), (4, 4096, 16, 16, 128, True, 0, 0.0, 0),
              (4, 4096, 16, 16, 128, False, 0, 30.0, 0), (4, 4096, 16, 16, 128, True, 0, 30.0, 0)],
    # Packed documents (segment ids): causal documents of 512, full ones of 1024.
    "docs": [(4, 4096, 16, 16, 128, True, 0, 0.0, 512), (4, 4096, 16, 16, 128, False, 0, 0.0, 1024)],
    # Our kernels only, beyond the peer table of "quick" (windows, packing, GQA, D, T).
    "extra": [(1, 16384, 16, 16, 128, True, 0, 0.0, 0), (1, 16384, 16, 16, 128, True, 512, 0.0, 0),
              (1, 16384, 16, 16, 128, True, 4096, 0.0, 0), (4, 4096, 16, 4, 128, True, 0, 0.0, 0),
              (4, 4096, 16, 16, 128, True, 0, 0.0, 512), (4, 4096, 16, 16, 64, True, 0, 0.0, 0),
              (2, 4096, 16, 16, 256, True, 0, 0.0, 0), (4, 1024, 16, 16, 128, False, 0, 0.0, 0),
              (1, 32768, 16, 16, 128, True, 0, 0.0, 0)],
    "full": [(4, 4096, 16, 16, 128, False, 0, 0.0, 0), (4, 4096, 16, 16, 128, True, 0, 0.0, 0),
             (4, 4096, 16, 16, 128, False, 0, 30.0, 0), (4, 4096, 16, 16, 128, True, 0, 30.0, 0),
             (4, 4096, 16, 16, 64, True, 0, 0.0, 0), (2, 4096, 16, 16, 256, True, 0, 0.0, 0),
             (4, 4096, 16, 4, 128, True, 0, 0.0, 0), (1, 16384, 16, 16, 128, True, 0, 0.0, 0),
             (1, 16384, 16, 16, 128, True, 512, 0.0, 0), (1, 16384, 16, 16, 128, True, 4096, 0.0, 0),
             (4, 4096, 16, 16, 128, True, 0, 0.0, 512), (1, 1024, 16, 16, 128, True, 0, 0.0, 0),
             (1, 32768, 16, 16, 128, True, 0, 0.0, 0)],
}
# The speed targets' shape classes (docs/BENCHMARKS.md): T of 1k, 4k and 16k at 16k tokens a
# call, head dims 64, 128 and 256, full and causal; T = 4096 first, so that a run cut short
# still has the headline shape's classes.
CONFIGS["targets"] = [(16384 // t, t, 16, 16, d, causal, 0, 0.0, 0)
                      for t in (4096, 1024, 16384) for d in (128, 64, 256)
                      for causal in (False, True)]


# --set features: each option of the contract added to one plain shape, timed
# in one round-robin group with the plain call (ua_kernels as it dispatches),
# for the target "each at >= 0.9x the plain configuration's speed". TFLOP/s
# count visible pairs, so packed documents are compared per useful FLOP.
FEATURE_SHAPES = [(4, 4096, 16, 128, False), (4, 4096, 16, 128, True)]  # B, T, H, D, causal
FEATURES = {
    "plain": {},
    "segment ids, 1 document": {"documents": 1},
    "segment ids, 4 documents": {"documents": 4},
    "temperature": {"temperature": True},
    "z-loss 1e-4": {"z_loss_weight": 1e-4},
    "GQA 16/4": {"kv_heads": 4},
    # The baseline of "4 documents": the same documents as 4 sequences.
    "4 sequences of T/4": {"sequences": 4},
}


def feature_rows(options):
  """Rows of --set features: every FEATURES entry of each FEATURE_SHAPES shape,
  timed together (time_interleaved) so that their ratios to "plain" hold."""
  rows = []
  for b, t, h, d, causal in FEATURE_SHAPES:
    rng = np.random.default_rng(0)
    dtype = jnp.dtype(options.dtype)
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), dtype)
    kv = {hkv: tuple(jnp.asarray(rng.normal(size=(b, t, hkv, d)), dtype) for _ in range(2))
          for hkv in {h, *(f.get("kv_heads", h) for f in FEATURES.values())}}
    temperature = jnp.asarray(rng.uniform(0.5, 2.0, size=(b, t, h)), jnp.float32)
    impls, flops, configs = {}, {}, {}
    for name, feature in FEATURES.items():
      doc = t // feature["documents"] if "documents" in feature else 0
      seg = None if not doc else jnp.asarray(np.repeat(np.arange(t // doc), doc)[None].repeat(b, 0))
      temp = temperature if feature.get("temperature") else None
      kw = dict(causal=causal, segment_ids=seg, temperature=temp,
                z_loss_weight=feature.get("z_loss_weight", 0.0))
      k, v = kv[feature.get("kv_heads", h)]
      split = feature.get("sequences", 1)
      args_q = q
      if split > 1:  # [B, T] -> [B * split, T / split]: each piece its own sequence
        args_q, k, v = (x.reshape(b * split, t // split, *x.shape[2:]) for x in (q, k, v))
        doc = t // split
      spec = validate(args_q, k, v, **kw)[0]
      config = default_config(spec, q.dtype)
      configs[name] = {**dataclasses.asdict(config), "shape": list(args_q.shape),
                       **backends_for(spec, config, q.dtype)._asdict()}
      static = {key: kw[key] for key in ("causal", "z_loss_weight")}
      impls[name] = (functools.partial(_with_runtime_options, ua_kernels.attention, **static),
                     (args_q, k, v, seg, temp))
      flops[name] = 4 * b * h * d * visible_pairs(t, causal, 0, doc)
    # Each call takes its own arguments (GQA's k and v have fewer heads), bound
    # outside jit so that q, k and v stay arguments, and every gradient is computed.
    bound = lambda wrap: {n: functools.partial(lambda fn, a: fn(*a), wrap(f), a)
                          for n, (f, a) in impls.items()}
    fwd = time_interleaved(bound(jax.jit), (), options.repeats)
    bwd = time_interleaved(bound(_fwd_bwd), (), options.repeats)
    label = f"B{b} T{t} H{h} D{d}" + ("" if options.dtype == "bfloat16" else " f16") + \
        (" causal" if causal else "")
    for name in impls:
      if any(isinstance(r, Exception) for r in (fwd[name], bwd[name])):
        failed = next(r for r in (fwd[name], bwd[name]) if isinstance(r, Exception))
        rows.append({"case": f"{label} {name}", "impl": "ua_kernels", "config": configs[name],
                     "error": f"{type(failed).__name__}: {failed}"[:200]})
        continue
      rows.append({"case": f"{label} {name}", "impl": "ua_kernels", "config": configs[name],
                   "feature": name, "fwd_ms": fwd[name], "fwd_bwd_ms": bwd[name],
                   "fwd_tflops": flops[name] / fwd[name] / 1e9,
                   "fwd_bwd_tflops": 3.5 * flops[name] / bwd[name] / 1e9})
  return rows


def print_feature_ratios(rows):
  """Each feature's TFLOP/s over the plain call's of the same shape, and the
  packed documents' over the same documents as separate sequences."""
  by = {(r["case"][:-len(r["feature"]) - 1], r["feature"]): r for r in rows if "feature" in r}
  for (shape, feature), r in by.items():
    if feature == "plain":
      continue
    bases = ["plain"]
    if feature.startswith("segment ids, ") and feature.endswith(" documents"):
      bases.append(f"{feature.split()[2]} sequences of T/{feature.split()[2]}")
    for base_name in bases:
      base = by.get((shape, base_name))
      if base:
        print(f"ratio {r['case']:56} vs {base_name:18} "
              f"fwd {r['fwd_tflops'] / base['fwd_tflops']:.2f}x  "
              f"fwd+bwd {r['fwd_bwd_tflops'] / base['fwd_bwd_tflops']:.2f}x")


def _options(argv):
  """(the parsed options, the implementations --impls names or None, the selected configurations)."""
  parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
  parser.add_argument("--set", default="quick", choices=sorted([*CONFIGS, "features", "decode"]))
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--no-peers", action="store_true")
  parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                      help="q, k, v dtype (every peer gets the same)")
  parser.add_argument("--json", default="bench.json")
  parser.add_argument("--cases", default=None,
                      help="comma-separated parts of case names, e.g. 'T16384,D64 causal': run "
                           "only the set's configurations whose name holds one; default: all")
  parser.add_argument("--memory", action="store_true",
                      help="also each implementation's fwd+bwd program's device memory beside "
                           "its arguments and outputs (XLA's memory analysis; one more compile "
                           "each)")
  parser.add_argument("--impls", default=None,
                      help="comma-separated names of the implementations to time (as the "
                           "result rows name them), e.g. ua_kernels,jax.nn.dpa[cudnn],tokamax; "
                           "default: all")
  options = parser.parse_args(argv)
  if options.repeats < 1:
    parser.error(f"--repeats must be at least 1, got {options.repeats}")
  wanted = None if options.impls is None else set(options.impls.split(","))
  known = {"ua_kernels", "ua_kernels[fused]", "ua_kernels[ordered]", "ua_kernels[triton]",
           *PEER_CONFIGS}
  if wanted is not None and (not wanted or wanted - known):
    parser.error(f"--impls names unknown implementations {sorted(wanted - known)}; "
                 f"known: {sorted(known)}")
  selected = selected_configs(options.set, options.dtype, options.cases)
  if options.cases is not None and not selected:
    parser.error(f"--cases {options.cases!r} names none of the set {options.set!r}'s cases")
  return options, wanted, selected


def _configuration_rows(label, shape, options, wanted) -> list:
  """The result rows of one configuration of the set: ua_kernels as it
  dispatches (the Mosaic kernels on Hopper) and with every kernel on
  Pallas-Triton, side by side, and the peers in the same interleaved runs."""
  b, t, hq, hkv, d, causal, window, cap, doc = shape
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(options.dtype)
  q = jnp.asarray(rng.normal(size=(b, t, hq, d)), dtype)
  k = jnp.asarray(rng.normal(size=(b, t, hkv, d)), dtype)
  v = jnp.asarray(rng.normal(size=(b, t, hkv, d)), dtype)
  seg = None if not doc else jnp.asarray(np.repeat(np.arange(t // doc), doc)[None].repeat(b, 0))
  flops = 4 * b * hq * d * visible_pairs(t, causal, window, doc)
  kw = dict(causal=causal, window_len=window, segment_ids=seg,
            cap_method="tanh" if cap else "none", cap_params=(cap,) if cap else ())
  spec = validate(q, k, v, **kw)[0]
  config = default_config(spec, q.dtype)
  # Segment ids, where there are any, are a fourth argument (the peers run
  # only configurations without them).
  static = {key: value for key, value in kw.items() if key != "segment_ids"}
  # The deterministic backward as the fused kernel with ordered adds, where it runs.
  ordered = KernelConfig(mosaic=MosaicTiles(ordered_fused=True))
  impls = {name: functools.partial(_with_runtime_options, fn, **static)
           for name, fn in (("ua_kernels", ua_kernels.attention),
                            ("ua_kernels[fused]", functools.partial(ua_kernels.attention,
                                                                    deterministic=False)),
                            ("ua_kernels[ordered]", functools.partial(ua_kernels.attention,
                                                                      config=ordered)),
                            ("ua_kernels[triton]", triton_attention))}
  args = (q, k, v) + ((seg,) if doc else ())
  configs = {"ua_kernels": {**dataclasses.asdict(config),
                            **backends_for(spec, config, q.dtype)._asdict()},
             "ua_kernels[fused]": {**dataclasses.asdict(config), **backends_for(
                 spec, config, q.dtype, deterministic=False)._asdict()},
             "ua_kernels[ordered]": {**dataclasses.asdict(dataclasses.replace(
                 config, mosaic=dataclasses.replace(config.mosaic, ordered_fused=True))),
                 **backends_for(spec, ordered, q.dtype)._asdict()},
             "ua_kernels[triton]": {**dataclasses.asdict(config), "forward": "triton",
                                    "backward": "triton"},
             **PEER_CONFIGS}
  if not options.no_peers:
    impls.update(peers(causal, window, cap, doc, hq, hkv))
  if wanted is not None:
    impls = {name: fn for name, fn in impls.items() if name in wanted}
  fwd = time_interleaved({n: jax.jit(f) for n, f in impls.items()}, args, options.repeats)
  grads = {n: _fwd_bwd(f) for n, f in impls.items()}
  bwd = time_interleaved(grads, args, options.repeats)
  temp = {n: _temp_mib(g, args) for n, g in grads.items()} if options.memory else {}
  stats = jax.devices()[0].memory_stats() or {}
  rows = []
  for name in impls:
    failed = [r for r in (fwd[name], bwd[name]) if isinstance(r, Exception)]
    if failed:
      rows.append({"case": label, "impl": name, "config": configs[name],
                   "error": f"{type(failed[0]).__name__}: {failed[0]}"[:200]})
      continue
    rows.append({"case": label, "impl": name, "config": configs[name],
                 "fwd_ms": fwd[name], "fwd_bwd_ms": bwd[name],
                 "fwd_tflops": flops / fwd[name] / 1e9,
                 "fwd_bwd_tflops": 3.5 * flops / bwd[name] / 1e9,
                 "peak_gib_so_far": stats.get("peak_bytes_in_use", 0) / 2 ** 30,
                 **({"fwd_bwd_temp_mib": temp[name]} if name in temp else {})})
  flex_wanted = wanted is None or {"torch_flex", "torch_flex_tanh"} & wanted
  if not options.no_peers and flex_wanted and not window and not doc and hq == hkv:
    flex = torch_flex(b, t, hq, d, causal, cap, options.repeats, options.dtype)
    if flex:
      name = "torch_flex" + ("_tanh" if cap else "")
      rows.append({"case": label, "impl": name, "config": configs[name],
                   "fwd_ms": flex[0], "fwd_bwd_ms": flex[1], "fwd_tflops": flops / flex[0] / 1e9,
                   "fwd_bwd_tflops": 3.5 * flops / flex[1] / 1e9})
  return rows


def _print_header(header) -> None:
  print(f"date={header['measured'][:10]} device={header['gpu']} commit={header['commit']} "
        + " ".join(f"{k}={v}" for k, v in header["versions"].items()))


def _print_rows(rows) -> None:
  width = max([38, *(len(r["case"]) for r in rows)])
  print(f"{'config':{width}} {'impl':20} {'fwd ms':>8} {'fwd TF/s':>9} {'f+b ms':>8} {'f+b TF/s':>9} "
        f"{'peak GiB':>8}")
  for r in rows:
    if "error" in r:
      print(f"{r['case']:{width}} {r['impl']:20} error: {r['error'][:60]}")
    else:
      print(f"{r['case']:{width}} {r['impl']:20} {r['fwd_ms']:8.3f} {r['fwd_tflops']:9.1f} "
            f"{r['fwd_bwd_ms']:8.3f} {r['fwd_bwd_tflops']:9.1f} {r.get('peak_gib_so_far', 0):8.1f}")


def main(argv=None):
  options, wanted, selected = _options(argv)
  if jax.default_backend() != "gpu":
    print(f"benchmarks.bench: no GPU (jax backend {jax.default_backend()}): the kernels run in the "
          "Pallas interpreter, slowly, and the times say nothing of a GPU", file=sys.stderr,
          flush=True)
  header = provenance(argv)
  if options.set == "decode":  # its own rows: forward GB/s, and the sinks' cost
    from benchmarks import decode
    rows = decode.decode_rows(options, time_interleaved, peers=not options.no_peers,
                              written=lambda rows: _write(options.json, header, rows))
    rows += decode.sink_rows(options, time_interleaved, _fwd_bwd)
    rows += decode.other_keys_rows(options, time_interleaved, _fwd_bwd)
    _write(options.json, header, rows)
    _print_header(header)
    decode.print_rows(rows)
    return
  rows = feature_rows(options) if options.set == "features" else []
  for label, shape in selected:
    rows += _configuration_rows(label, shape, options, wanted)
    _write(options.json, header, rows)  # after every configuration: a run cut short keeps its rows
  _print_header(header)
  _print_rows(rows)
  print_target_ratios(rows)
  print_feature_ratios(rows)
  _write(options.json, header, rows)


def case_label(dtype, b, t, hq, hkv, d, causal, window, cap, doc) -> str:
  """A configuration's name in result rows, e.g. "B4 T4096 H16/16 D128 causal"."""
  return (f"B{b} T{t} H{hq}/{hkv} D{d}" + ("" if dtype == "bfloat16" else " f16")
          + (" causal" if causal else "") + (f" win{window}" if window else "")
          + (f" tanh{cap:g}" if cap else "") + (f" docs{doc}" if doc else ""))


def selected_configs(set_name, dtype, cases=None) -> list:
  """[(label, configuration)] of a set, those whose label holds one of the
  comma-separated ``cases`` where given: a run cut short is finished by
  naming what it did not reach."""
  parts = None if cases is None else [c.strip() for c in cases.split(",") if c.strip()]
  out = [(case_label(dtype, *config), config) for config in CONFIGS.get(set_name, ())]
  return [(label, config) for label, config in out
          if parts is None or any(part in label for part in parts)]


def _write(path, header, rows):
  with open(path, "w") as f:
    json.dump({**header, "rows": rows}, f, indent=1)


def print_target_ratios(rows):
  """The targets as ratios within this run (peer time / ours: above 1, ours is
  faster), each against a peer timed in the same round-robin group: JAX's
  Pallas-Triton kernel (for a tanh cap, its no-cap kernel), FlexAttention-tanh,
  tokamax (at both its configs) and cuDNN; for a tanh-capped configuration, cuDNN's no-cap time of the same
  shape (timed in its own group: cuDNN has no cap)."""
  by = {(r["case"], r["impl"]): r for r in rows if "error" not in r}
  for (config, impl), r in sorted(by.items()):
    if not impl.startswith("ua_kernels"):
      continue
    nocap = " ".join(word for word in config.split() if not word.startswith("tanh"))
    for peer, where in (("jax_pallas_triton", config), ("jax_pallas_triton_nocap", config),
                        ("torch_flex_tanh", config), ("tokamax", config),
                        ("tokamax[h100_best]", config), ("jax.nn.dpa[cudnn]", nocap)):
      other = by.get((where, peer))
      if other and (peer != "torch_flex_tanh" or "tanh" in config):
        print(f"ratio {config:36} {impl:18} vs {peer:24} "
              f"fwd {other['fwd_ms'] / r['fwd_ms']:.2f}x  "
              f"fwd+bwd {other['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x")


if __name__ == "__main__":
  main()
