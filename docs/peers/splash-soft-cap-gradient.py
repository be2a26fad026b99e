"""Splash attention's soft-cap backward multiplies ds by (1 - t)(1 + t), t = tanh(x / c)
(splash_attention_kernel.py: `g = ds * (1 - d); ds = g + g * d`): where the cap saturates,
1 - t keeps only t's last bits, so dq and dk there are as wrong as tanh's rounding. Here one
query sees 8 keys whose float32 logits sit 3-9 cap widths out; splash's dq (float32,
interpret mode off a TPU) against float64 autodiff of the same attention, and against the
float32 derivative 4e / (1 + e)^2, e = exp(-2|x/c|), which does not cancel. jax alone.
python3 splash-soft-cap-gradient.py"""
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

print("jax", jax.__version__, jax.default_backend())
t, d, cap = 128, 128, 1.0
rng = np.random.default_rng(0)
u = rng.normal(size=d) / np.sqrt(d)
q = np.tile(u * 6.0, (1, t, 1)).astype(np.float32)  # every logit about 6 * |u|^2 * k-scale
k = (u[None, None] * rng.uniform(0.5, 1.5, size=(1, t, 1))).astype(np.float32)
v = rng.normal(size=(1, t, d)).astype(np.float32)
do = rng.normal(size=(1, t, d)).astype(np.float32)
kernel = sk.make_splash_mha_single_device(sm.MultiHeadMask([sm.FullMask((t, t))]),
                                          attn_logits_soft_cap=cap,
                                          interpret=jax.default_backend() != "tpu")
_, vjp = jax.vjp(kernel, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
dq = np.asarray(vjp(jnp.asarray(do))[0], np.float64)

with jax.enable_x64(True):
  def exact(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k)
    s = cap * jnp.tanh(s / cap)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)
  _, vjp64 = jax.vjp(exact, *(np.asarray(x, np.float64) for x in (q, k, v)))
  dq64 = np.asarray(vjp64(np.asarray(do, np.float64))[0])


def tanh_free(y):  # tanh whose autodiff derivative 4e / (1 + e)^2 does not cancel
  a = jnp.where(y >= 0, y, -y)
  e = jnp.exp(-2.0 * a)
  f = jnp.where(a < 0.5, -jnp.expm1(-2.0 * a), 1.0 - e) / (1.0 + e)
  return jnp.where(y >= 0, f, -f)


def float32(q, k, v):
  s = cap * tanh_free(jnp.einsum("hqd,hkd->hqk", q, k) / cap)
  return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


_, vjp32 = jax.vjp(float32, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
dq32 = np.asarray(vjp32(jnp.asarray(do))[0], np.float64)
logits = np.einsum("hqd,hkd->hqk", q, k)
print(f"logits / cap: {np.min(logits) / cap:.1f} to {np.max(logits) / cap:.1f}")
scale = np.max(np.abs(dq64))
print(f"float32 dq against float64, max error over max |dq|: splash {np.max(np.abs(dq - dq64)) / scale:.2e}, "
      f"float32 with a derivative that does not cancel {np.max(np.abs(dq32 - dq64)) / scale:.2e}")
