"""Splash attention under jax_enable_x64. Off a TPU (interpret mode): the MHA kernel with GQA
(4 query heads on 2 kv heads) raises, its index maps dividing an int32 grid index by an int64
group size (splash_attention_kernel._div -> lax.div); MHA without GQA and the MQA kernel run,
forward and backward (splash-x64-gqa.log). On a TPU v5e no kernel compiles under x64: MHA
without GQA and the MQA kernel (what a GQA caller uses per kv head) fail Mosaic's
verification, 'arith.muli' op requires the same type for all operands (i32, i64)
(splash-x64-gqa-tpu.log). jax alone. python3 splash-x64-gqa.py"""
import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

jax.config.update("jax_enable_x64", True)
print("jax", jax.__version__, jax.default_backend())
t, d = 128, 128
interpret = jax.default_backend() != "tpu"


def first_line(exc):
  return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def run(name, kernel, q, kv):
  try:
    out = kernel(q, kv, kv)
    print(f"{name} forward: ran, out {out.shape} {out.dtype}")
    grad = jax.grad(lambda q: kernel(q, kv, kv).sum())(q)
    print(f"{name} backward: ran, dq {grad.shape} {grad.dtype}")
  except Exception as exc:  # noqa: BLE001
    print(f"{name}: {first_line(exc)}")


for hq, hkv in ((2, 2), (4, 2)):
  mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * hq)
  run(f"MHA Hq={hq} Hkv={hkv}", sk.make_splash_mha_single_device(mask, interpret=interpret),
      jnp.ones((hq, t, d), jnp.float32), jnp.ones((hkv, t, d), jnp.float32))
mask = sm.MultiHeadMask([sm.CausalMask((t, t))] * 4)
run("MQA Hq=4 (one kv head)", sk.make_splash_mqa_single_device(mask, interpret=interpret),
    jnp.ones((4, t, d), jnp.float32), jnp.ones((t, d), jnp.float32))
