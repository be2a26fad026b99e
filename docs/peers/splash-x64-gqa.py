"""Splash attention's MHA kernel with GQA (4 query heads on 2 kv heads) raises under
jax_enable_x64: its index maps divide an int32 grid index by an int64 group size
(splash_attention_kernel._div -> lax.div). MHA without GQA, and the MQA kernel, run.
jax alone; interpret mode off a TPU. python3 splash-x64-gqa.py"""
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

jax.config.update("jax_enable_x64", True)
print("jax", jax.__version__, jax.default_backend())
t, d = 128, 128
interpret = jax.default_backend() != "tpu"
for hq, hkv in ((2, 2), (4, 2)):
  kernel = sk.make_splash_mha_single_device(
      sm.MultiHeadMask([sm.CausalMask((t, t))] * hq), interpret=interpret)
  q = jnp.ones((hq, t, d), jnp.float32)
  kv = jnp.ones((hkv, t, d), jnp.float32)
  try:
    out = kernel(q, kv, kv)
    print(f"Hq={hq} Hkv={hkv}: ran, out {out.shape} {out.dtype}")
  except Exception as exc:  # noqa: BLE001
    print(f"Hq={hq} Hkv={hkv}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
