"""Where the Mosaic backend's forward+backward time goes, kernel by kernel, on Hopper:
python -m benchmarks.breakdown --json breakdown.json

For each configuration of ua-bench's quick set it times, interleaved: the
Mosaic forward, the delta term (XLA), the dq kernel, the dk/dv kernel, the
whole forward+backward, and cuDNN's forward and forward+backward. Each kernel
also gets its TFLOP/s over the matmuls it does (forward 2, dq 3, dk/dv 4 tile
products of 2*T*T*D flops each over visible pairs).
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ua_kernels
from benchmarks.bench import CONFIGS, _fwd_bwd, provenance, time_interleaved, visible_pairs
from ua_kernels import cap_forms
from ua_kernels.mosaic import backward as mosaic_backward
from ua_kernels.mosaic import forward as mosaic_forward
from ua_kernels.tuned_configs import default_config
from ua_reference.contract import validate

attention_module = sys.modules["ua_kernels.attention"]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--json", default="breakdown.json")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  header = provenance()
  rows = []
  for b, t, hq, hkv, d, causal, window, cap, doc in CONFIGS["quick"]:
    rng = np.random.default_rng(0)
    q, k, v, dout = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.bfloat16)
                     for h in (hq, hkv, hkv, hq))
    kw = dict(causal=causal, window_len=window,
              cap_method="tanh" if cap else "none", cap_params=(cap,) if cap else ())
    spec = validate(q, k, v, **kw)[0]
    config = default_config(spec, q.dtype)
    fast_cap = cap_forms.fast_cap(spec, q.dtype)
    out, lse2 = jax.jit(lambda q, k, v: mosaic_forward.forward(
        spec, config.mosaic, q, k, v, None, None, fast_cap=fast_cap))(q, k, v)
    dlse = jnp.zeros(lse2.shape, jnp.float32)
    delta = attention_module._delta(spec, out, dout, lse2, dlse)

    def part(kernels):
      # The residuals are arguments of the jitted function, not constants baked into it.
      run = jax.jit(lambda q, k, v, lse2, delta, dout: mosaic_backward.backward(
          spec, config.mosaic, q, k, v, None, None, lse2, delta, dout, fast_cap=fast_cap,
          kernels=kernels))
      return lambda q, k, v: run(q, k, v, lse2, delta, dout)

    run_delta = jax.jit(lambda out, dout, lse2, dlse: attention_module._delta(
        spec, out, dout, lse2, dlse))

    fns = {
        "forward": jax.jit(lambda q, k, v: mosaic_forward.forward(
            spec, config.mosaic, q, k, v, None, None, fast_cap=fast_cap)),
        "delta": lambda q, k, v: run_delta(out, dout, lse2, dlse),
        "dq kernel": part(("dq",)),
        "dk/dv kernel": part(("dkv",)),
        "forward+backward": _fwd_bwd(lambda q, k, v: ua_kernels.attention(q, k, v, **kw)),
    }
    if not cap:
      cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                           implementation="cudnn")
      fns["cudnn forward"] = jax.jit(cudnn)
      fns["cudnn forward+backward"] = _fwd_bwd(cudnn)
    times = time_interleaved(fns, (q, k, v), args.repeats)
    pair_flops = 2 * b * hq * d * visible_pairs(t, causal, window, doc)
    matmuls = {"forward": 2, "dq kernel": 3, "dk/dv kernel": 4, "cudnn forward": 2}
    label = f"B{b} T{t} H{hq} D{d}" + (" causal" if causal else "") + (f" tanh{cap:g}" if cap
                                                                         else "")
    for name, ms in times.items():
      row = {"case": label, "part": name}
      if isinstance(ms, float):
        row["ms"] = ms
        if name in matmuls:
          row["matmul_tflops"] = matmuls[name] * pair_flops / ms / 1e9
      else:
        row["error"] = f"{type(ms).__name__}: {ms}"[:200]
      rows.append(row)
      print(f"{label:34} {name:24} " + (f"{ms:8.3f} ms" if isinstance(ms, float) else
                                         row["error"][:60])
            + (f"  {row['matmul_tflops']:6.1f} TF/s" if "matmul_tflops" in row else ""),
            flush=True)
  with open(args.json, "w") as f:
    json.dump({**header, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
