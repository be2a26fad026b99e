"""Compiled-kernel smoke check on a GPU: every feature once, against the
reference; prints one line per case.

``python -m benchmarks.gpu_smoke [N ...]`` runs only the cases numbered N
(from 1, in CASES order), to fit a time limit."""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
import ua_reference

CASES = [
    dict(b=2, t=256, hq=4, hkv=4, d=64, dtype=jnp.bfloat16, kw={}),
    dict(b=2, t=300, hq=8, hkv=2, d=80, dtype=jnp.float16, kw=dict(causal=True, window_len=70)),
    dict(b=1, t=1000, hq=4, hkv=1, d=128, dtype=jnp.bfloat16,
         kw=dict(causal=True, cap_method="tanh", cap_params=(5.0,), z_loss_weight=0.1)),
    dict(b=2, t=17, hq=2, hkv=1, d=16, dtype=jnp.bfloat16, kw=dict(seg=True, temp=True)),
    dict(b=2, t=1000, hq=4, hkv=2, d=128, dtype=jnp.bfloat16, kw={}),
    # Packed documents over many tiles: the loops skip tiles outside the segment spans.
    dict(b=2, t=1000, hq=4, hkv=4, d=128, dtype=jnp.bfloat16, kw=dict(causal=True, seg=True)),
    dict(b=1, t=777, hq=2, hkv=2, d=96, dtype=jnp.float16, kw=dict(causal=True)),
    dict(b=1, t=512, hq=4, hkv=2, d=64, dtype=jnp.float32,
         kw=dict(causal=True, seg=True, temp=True, cap_method="asym_tanh", cap_params=(2.0, 1.0))),
    # Last: float32 D=256 is the slowest to compile.
    dict(b=1, t=129, hq=2, hkv=2, d=256, dtype=jnp.float32, kw=dict(cap_method="hard", cap_params=(1.0,))),
]


def main(argv=None):
  picked = [int(n) for n in (sys.argv[1:] if argv is None else argv)]
  print("devices:", jax.devices(), "x64:", jax.config.jax_enable_x64)
  bad = 0
  for number, c in enumerate(CASES, 1):
    if picked and number not in picked:
      continue
    rng = np.random.default_rng(0)
    kw = dict(c["kw"])
    mk = lambda h: jnp.asarray(rng.normal(size=(c["b"], c["t"], h, c["d"])), c["dtype"])
    q, k, v = mk(c["hq"]), mk(c["hkv"]), mk(c["hkv"])
    if kw.pop("seg", False):
      kw["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, size=(c["b"], c["t"]))), jnp.int32)
    if kw.pop("temp", False):
      kw["temperature"] = jnp.asarray(rng.uniform(0.5, 2, size=(c["b"], c["t"], c["hq"])), jnp.float32)
    def loss(f):
      return lambda q, k, v: jnp.sum(f(q, k, v, return_lse=True, **kw)[0].astype(jnp.float32) ** 2)
    try:
      o1, l1 = ua_kernels.attention(q, k, v, return_lse=True, **kw)
      g1 = jax.grad(loss(ua_kernels.attention), argnums=(0, 1, 2))(q, k, v)
      o2, l2 = ua_reference.attention(q, k, v, return_lse=True, **kw)
      g2 = jax.grad(loss(ua_reference.attention), argnums=(0, 1, 2))(q, k, v)
      rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                               / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30))
      errs = [rel(o1, o2), rel(l1, l2)] + [rel(a, b) for a, b in zip(g1, g2)]
      finite = all(bool(jnp.isfinite(x.astype(jnp.float32)).all()) for x in (o1, l1, *g1))
      tol = 3e-2 if c["dtype"] != jnp.float32 else 1e-4
      ok = finite and max(errs) < tol
      bad += not ok
      print(("OK  " if ok else "BAD ") + f"{number}: {c['dtype'].__name__} t={c['t']} d={c['d']} {c['kw']} "
            f"rel errs out/lse/dq/dk/dv: " + " ".join(f"{e:.1e}" for e in errs), flush=True)
    except Exception as exc:  # noqa: BLE001
      bad += 1
      print(f"ERR {number}: {c}: {type(exc).__name__}: {str(exc)[:2000]}", flush=True)
  sys.exit(1 if bad else 0)


if __name__ == "__main__":
  main()
