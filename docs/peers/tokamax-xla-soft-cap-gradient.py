"""tokamax 0.0.17's XLA attention op caps logits as ``c * tanh(x / c)``
(tokamax/_src/ops/attention/base.py:725-726) and leaves the derivative to JAX's
autodiff, 1 - tanh(x / c)**2, which is exactly 0 in float32 wherever tanh rounds
to 1 (|x / c| past about 9), though the true derivative there is up to 1e-7:
those logits' gradients vanish, and dq and dk lean toward zero
(docs/verification/cases/tokamax_xla-bfloat16-saturated-cap-bias.min.json).
jax and numpy alone: the cap's derivative at saturated points, float32 against float64."""
import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)
c = 0.4
x = np.array([2.0, 3.0, 3.5, 4.0, 5.0, 8.0])  # logits / c = 5 .. 20
cap = lambda x: c * jnp.tanh(x / c)
for dtype in (jnp.float32, jnp.float64):
  grads = jax.vmap(jax.grad(cap))(jnp.asarray(x, dtype))
  print(f"{jnp.dtype(dtype).name:8}", " ".join(f"{g:.3e}" for g in np.asarray(grads, np.float64)))
exact = 1.0 / np.cosh(x / c) ** 2
print("sech^2  ", " ".join(f"{g:.3e}" for g in exact))
