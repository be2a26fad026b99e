"""``ua-bench --set decode``: decode against a KV cache, and the cost of sinks.

Decode rows: Tq of 1 and 8 queries against Tk of 4k, 32k and 128k keys, GQA
32/8, D 128, forward only (inference), no mask (every query sees every key,
the same work for every peer: jax.nn's causal mask aligns the first query with
the first key, the contract the last with the last). Decode reads the cache
once per call, so each row gives the K/V bandwidth, GB/s, beside the time.
Implementations: ua_kernels as it dispatches (split keys and packed GQA heads
by its table, ua_kernels.triton.tuned), the same without each and without
either (the plain forward), cuDNN and XLA
through jax.nn.dot_product_attention, and tokamax where installed: its
Pallas-Triton kernel at its own config and with split_k, and its Mosaic GPU
kernel. Sinks rows: one call with and without sinks, forward and
forward+backward, ua_kernels as it dispatches, on Pallas-Triton and (equal
lengths) on Mosaic GPU. Other-keys rows: a chunk of prefill against a longer
cache and cross-attention, on Pallas-Triton and with the Mosaic forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from ua_kernels import KernelConfig
from ua_kernels.attention import backends_for
from ua_kernels.tuned_configs import default_config
from ua_reference.contract import validate_call

# (B, Tq, Tk, Hq, Hkv, D)
DECODE_SHAPES = [(1, tq, tk, 32, 8, 128) for tq in (1, 8) for tk in (4096, 32768, 131072)]
DECODE_SHAPES += [(8, 1, 32768, 32, 8, 128)]
# tokamax's Pallas-Triton kernel splits the keys by vmap (split_k); these are tried.
TOKAMAX_SPLITS = (16,)
# (B, Tq, Tk, H, D, causal): a prefill and a decode call, with and without sinks.
SINK_SHAPES = [(4, 4096, 4096, 16, 128, True), (1, 1, 32768, 32, 128, False)]
# (B, Tq, Tk, Hq, Hkv, D, causal): a chunk of prefill against a longer cache, and
# cross-attention, on each backend.
OTHER_KEYS_SHAPES = [(1, 4096, 16384, 32, 8, 128, True), (2, 2048, 8192, 16, 16, 128, False)]


def _tokamax_decode_peers() -> dict:
  """name -> attention(q, k, v) of tokamax's kernels without a mask, or none
  where tokamax is not installed."""
  try:
    from properties.peers import impls_tokamax
    impls_tokamax.install_xprof_stub()
    from tokamax._src.ops.attention import base as tk_base
    from tokamax._src.ops.attention import pallas_triton as tk_triton
  except ImportError:
    return {}

  def call(op, q, k, v, **kw):
    out = op(q, k, v, logits_scale=q.shape[-1] ** -0.5, **kw)
    return out[0] if isinstance(out, tuple) else out

  peers = {"tokamax[triton]": functools.partial(call, tk_triton.PallasTritonFlashAttention())}
  for splits in TOKAMAX_SPLITS:
    config = tk_triton.Config(block_q=16, block_k=64, num_stages=2, num_warps=4, split_k=splits)
    peers[f"tokamax[triton split_k={splits}]"] = functools.partial(
        call, tk_triton.PallasTritonFlashAttention(config=config))
  peers["tokamax[mosaic]"] = lambda q, k, v: call(
      impls_tokamax._op(jnp.dtype(q.dtype).name, None, None), q, k, v,
      mask=tk_base.Mask(is_causal=False))
  return peers


def _config_row(q, k, **kw) -> dict:
  spec = validate_call(q, k, k, **kw).spec
  config = default_config(spec, q.dtype)
  return {**dataclasses.asdict(config), **backends_for(spec, config, q.dtype)._asdict()}


def _inputs(b, tq, tk, hq, hkv, d, dtype):
  """q [B, Tq, Hq, D], k and v [B, Tk, Hkv, D], standard normal, and the rng
  that drew them (seed 0)."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype) for _ in range(2))
  return q, k, v, rng


def decode_rows(options, time_interleaved, peers: bool = True, written=None) -> list:
  """One row per (shape, implementation): forward ms and K/V GB/s; ``written``
  (rows -> None) is called after each shape, so that a run cut short keeps them."""
  rows = []
  dtype = jnp.dtype(options.dtype)
  for b, tq, tk, hq, hkv, d in DECODE_SHAPES:
    q, k, v, _ = _inputs(b, tq, tk, hq, hkv, d, dtype)
    impls = {"ua_kernels": ua_kernels.attention}
    for name, config in (("kv_splits=1", KernelConfig(kv_splits=1)),
                         ("pack_gqa=False", KernelConfig(pack_gqa=False)),
                         ("neither", KernelConfig(kv_splits=1, pack_gqa=False))):
      impls[f"ua_kernels[{name}]"] = functools.partial(ua_kernels.attention, config=config)
    if peers:
      for impl in ("cudnn", "xla"):
        impls[f"jax.nn.dpa[{impl}]"] = functools.partial(jax.nn.dot_product_attention,
                                                         implementation=impl)
      impls.update(_tokamax_decode_peers())
    ms = time_interleaved({n: jax.jit(f) for n, f in impls.items()}, (q, k, v), options.repeats)
    kv_bytes = 2 * k.size * dtype.itemsize
    label = f"decode B{b} Tq{tq} Tk{tk} H{hq}/{hkv} D{d}" + ("" if dtype == jnp.bfloat16 else " f16")
    config = _config_row(q, k)
    for name, result in ms.items():
      row = {"case": label, "impl": name, "config": config if name.startswith("ua_") else name}
      if isinstance(result, Exception):
        row["error"] = f"{type(result).__name__}: {result}"[:200]
      else:
        row.update(fwd_ms=result, kv_gbps=kv_bytes / result / 1e6)
      rows.append(row)
    if written is not None:
      written(rows)
  return rows


def sink_rows(options, time_interleaved, fwd_bwd) -> list:
  """Each SINK_SHAPES call with sinks and without, forward and forward+backward,
  timed in one round-robin group."""
  rows = []
  dtype = jnp.dtype(options.dtype)
  for b, tq, tk, h, d, causal in SINK_SHAPES:
    q, k, v, rng = _inputs(b, tq, tk, h, h, d, dtype)
    sinks = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    impls = {}
    # Mosaic takes sinks at equal lengths (forced: "auto" keeps sinks on Triton, for now).
    for backend in ("auto", "triton") + (("mosaic",) if tq == tk else ()):
      config = KernelConfig(backend=backend)
      name = "ua_kernels" + ("" if backend == "auto" else f"[{backend}]")
      impls[f"{name} plain"] = functools.partial(ua_kernels.attention, causal=causal, config=config)
      impls[f"{name} sinks"] = functools.partial(
          lambda q, k, v, config: ua_kernels.attention(q, k, v, sinks=sinks, causal=causal,
                                                       config=config), config=config)
    times = _fwd_and_fwd_bwd(impls, (q, k, v), options, time_interleaved, fwd_bwd)
    label = f"sinks B{b} Tq{tq} Tk{tk} H{h} D{d}" + (" causal" if causal else "") + \
        ("" if dtype == jnp.bfloat16 else " f16")
    rows += [{"case": f"{label} {name.split()[-1]}", "impl": name.split()[0], "feature": name,
              **times[name]} for name in impls]
  return rows


def _fwd_and_fwd_bwd(impls, args, options, time_interleaved, fwd_bwd) -> dict:
  """name -> {fwd_ms, fwd_bwd_ms} of each implementation, each direction timed
  in one round-robin group, or {error} where either failed."""
  fwd = time_interleaved({n: jax.jit(f) for n, f in impls.items()}, args, options.repeats)
  bwd = time_interleaved({n: fwd_bwd(f) for n, f in impls.items()}, args, options.repeats)
  times = {}
  for name in impls:
    failed = [r for r in (fwd[name], bwd[name]) if isinstance(r, Exception)]
    times[name] = ({"error": f"{type(failed[0]).__name__}: {failed[0]}"[:200]} if failed
                   else {"fwd_ms": fwd[name], "fwd_bwd_ms": bwd[name]})
  return times


def other_keys_rows(options, time_interleaved, fwd_bwd) -> list:
  """Each OTHER_KEYS_SHAPES call on Pallas-Triton (where "auto" runs it) and
  with the Mosaic forward (its backward on Triton), forward and
  forward+backward, timed in one round-robin group."""
  rows = []
  dtype = jnp.dtype(options.dtype)
  for b, tq, tk, hq, hkv, d, causal in OTHER_KEYS_SHAPES:
    q, k, v, _ = _inputs(b, tq, tk, hq, hkv, d, dtype)
    impls = {f"ua_kernels[{backend}]": functools.partial(
        ua_kernels.attention, causal=causal, config=KernelConfig(backend=backend))
        for backend in ("triton", "mosaic")}
    times = _fwd_and_fwd_bwd(impls, (q, k, v), options, time_interleaved, fwd_bwd)
    label = (f"keys B{b} Tq{tq} Tk{tk} H{hq}/{hkv} D{d}" + (" causal" if causal else "")
             + ("" if dtype == jnp.bfloat16 else " f16"))
    rows += [{"case": label, "impl": name, **times[name]} for name in impls]
  return rows


def print_rows(rows):
  """The decode table (GB/s and the ratio to ua_kernels) and the sinks' ratios."""
  ours = {r["case"]: r for r in rows if r["impl"] == "ua_kernels" and "fwd_ms" in r}
  for r in rows:
    if "kv_gbps" in r:
      base = ours.get(r["case"])
      ratio = f"{r['fwd_ms'] / base['fwd_ms']:.2f}x ours" if base else ""
      print(f"{r['case']:44} {r['impl']:30} {r['fwd_ms']:8.3f} ms {r['kv_gbps']:7.0f} GB/s {ratio}")
    elif "error" in r:
      print(f"{r['case']:44} {r['impl']:30} error: {r['error'][:70]}")
  for r in rows:
    if r["case"].startswith("keys") and "fwd_ms" in r:
      print(f"{r['case']:44} {r['impl']:30} fwd {r['fwd_ms']:8.3f} ms  "
            f"fwd+bwd {r['fwd_bwd_ms']:8.3f} ms")
  sinks = {(r["case"].rsplit(" ", 1)[0], r["feature"]): r for r in rows
           if r.get("feature") and "fwd_bwd_ms" in r}
  for (label, feature), r in sinks.items():
    if not feature.endswith(" sinks"):
      continue
    for base_name in dict.fromkeys((feature.replace(" sinks", " plain"), "ua_kernels[triton] plain")):
      base = sinks.get((label, base_name))
      if base:
        print(f"ratio {label:40} {feature:26} vs {base_name:26} "
              f"fwd {base['fwd_ms'] / r['fwd_ms']:.2f}x  "
              f"fwd+bwd {base['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}x")
