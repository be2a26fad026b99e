"""Bad input raises ValueError/TypeError naming the argument, in every implementation."""

import jax.numpy as jnp
import numpy as np
import pytest

import ua_kernels
import ua_reference
from ua_kernels import KernelConfig

IMPLS = {"reference": ua_reference.attention, "kernels": ua_kernels.attention}
B, T, H, D = 2, 8, 4, 16


def _qkv(dtype=jnp.float32, hkv=2):
  rng = np.random.default_rng(0)
  return (jnp.asarray(rng.normal(size=(B, T, H, D)), dtype),
          jnp.asarray(rng.normal(size=(B, T, hkv, D)), dtype),
          jnp.asarray(rng.normal(size=(B, T, hkv, D)), dtype))


q, k, v = _qkv()
BAD = {
    "q rank": ((q[0], k, v), {}, ValueError, "q must have rank 4"),
    "k rank": ((q, k[0], v), {}, ValueError, "k must have rank 4"),
    "not an array": (([1, 2], k, v), {}, TypeError, "q must be an array"),
    "integer q": ((q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32)), {},
                  TypeError, "floating dtype"),
    "dtype mismatch": ((q, k.astype(jnp.bfloat16), v), {}, TypeError, "share one dtype"),
    "k/v shape": ((q, k, v[:, :, :1]), {}, ValueError, "k and v must have the same shape"),
    "seq mismatch": ((q, k[:, :4], v[:, :4]), {}, ValueError, "k/v must have shape"),
    "head dim": ((q, k[..., :8], v[..., :8]), {}, ValueError, "head dim mismatch"),
    "heads not divisible": ((q, *_qkv(hkv=3)[1:]), {}, ValueError, "divisible"),
    "unknown cap": ((q, k, v), {"cap_method": "nope"}, ValueError, "unknown cap_method"),
    "cap as int": ((q, k, v), {"cap_method": 3}, TypeError, "cap_method must be a string"),
    "cap params count": ((q, k, v), {"cap_method": "tanh"}, ValueError, "takes 1 cap_params"),
    "cap params two": ((q, k, v), {"cap_method": "asym_tanh", "cap_params": (1.0,)},
                       ValueError, "takes 2 cap_params"),
    "non-positive cap": ((q, k, v), {"cap_method": "tanh", "cap_params": (0.0,)},
                         ValueError, "positive finite"),
    "negative cap": ((q, k, v), {"cap_method": "hard", "cap_params": (-1.0,)},
                     ValueError, "positive finite"),
    "nan cap": ((q, k, v), {"cap_method": "hard", "cap_params": (float("nan"),)},
                ValueError, "positive finite"),
    "negative window": ((q, k, v), {"window_len": -1}, ValueError, "window_len must be >= 0"),
    "float window": ((q, k, v), {"window_len": 2.5}, TypeError, "window_len"),
    "causal not bool": ((q, k, v), {"causal": 1}, TypeError, "causal must be a bool"),
    "segment shape": ((q, k, v), {"segment_ids": jnp.zeros((B, T + 1), jnp.int32)},
                      ValueError, "segment_ids must have shape"),
    "segment dtype": ((q, k, v), {"segment_ids": jnp.zeros((B, T), jnp.float32)},
                      TypeError, "segment_ids must have an integer dtype"),
    "temperature shape": ((q, k, v), {"temperature": jnp.ones((3,))}, ValueError,
                          "temperature of shape"),
    "temperature rank": ((q, k, v), {"temperature": jnp.ones((1, B, T, H))}, ValueError,
                         "temperature of shape"),
    "temperature dtype": ((q, k, v), {"temperature": jnp.ones((B, T, H), jnp.int32)},
                          TypeError, "temperature must have a floating dtype"),
    "negative z-loss": ((q, k, v), {"z_loss_weight": -0.1}, ValueError, "z_loss_weight"),
    "inf sm_scale": ((q, k, v), {"sm_scale": float("inf")}, ValueError, "sm_scale must be finite"),
    "return_lse not bool": ((q, k, v), {"return_lse": "yes"}, TypeError, "return_lse"),
}


@pytest.mark.parametrize("impl", sorted(IMPLS))
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises(impl, name):
  args, kwargs, error, message = BAD[name]
  with pytest.raises(error, match=message):
    IMPLS[impl](*args, **kwargs)


def test_kernels_reject_float64():
  with pytest.raises(TypeError, match="supports q/k/v dtypes"):
    ua_kernels.attention(*(np.zeros((1, 4, 1, 16)),) * 3)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"block_q": 24}, ValueError, "power of two >= 16"),
    ({"block_kv": 8}, ValueError, "power of two >= 16"),
    ({"block_kv_dkv": 64.0}, TypeError, "must be an int"),
    ({"num_warps": 3}, ValueError, "num_warps"),
    ({"num_stages": 0}, ValueError, "num_stages"),
    ({"interpret": "yes"}, TypeError, "interpret"),
])
def test_kernel_config_errors(kwargs, error, message):
  with pytest.raises(error, match=message):
    KernelConfig(**kwargs)


def test_kernels_reject_non_config():
  with pytest.raises(TypeError, match="config must be a KernelConfig"):
    ua_kernels.attention(q, k, v, config={"block_q": 16})
