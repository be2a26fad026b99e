"""Bad input raises ValueError/TypeError naming the argument, in every implementation."""

import jax
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
    "batch mismatch": ((q, k[:1], v[:1]), {}, ValueError, "k/v must have shape"),
    "head dim": ((q, k[..., :8], v[..., :8]), {}, ValueError, "head dim mismatch"),
    "heads not divisible": ((q, *_qkv(hkv=3)[1:]), {}, ValueError, "divisible"),
    "unknown cap": ((q, k, v), {"cap_method": "nope"}, ValueError, "unknown cap_method"),
    "cap as int": ((q, k, v), {"cap_method": 3}, TypeError, "cap_method must be a string"),
    "cap params count": ((q, k, v), {"cap_method": "tanh"}, ValueError, "takes 1 cap_params"),
    "cap params two": ((q, k, v), {"cap_method": "asym_tanh", "cap_params": (1.0,)},
                       ValueError, "takes 2 cap_params"),
    "non-positive cap": ((q, k, v), {"cap_method": "tanh", "cap_params": (0.0,)},
                         ValueError, "positive finite"),
    "subnormal cap": ((q, k, v), {"cap_method": "tanh", "cap_params": (1e-39,)},
                      ValueError, "normal float32 magnitude"),
    "cap past float32": ((q, k, v), {"cap_method": "tanh", "cap_params": (1e39,)},
                         ValueError, "normal float32 magnitude"),
    "sm_scale past float32": ((q, k, v), {"sm_scale": 1e38 * 10}, ValueError,
                              "sm_scale must be 0 or a normal float32"),
    "subnormal sm_scale": ((q, k, v), {"sm_scale": 1e-40}, ValueError,
                           "sm_scale must be 0 or a normal float32"),
    "z_loss past float32": ((q, k, v), {"z_loss_weight": 1e39}, ValueError,
                            "z_loss_weight must be 0 or a normal float32"),
    # Not read as floats: a bool (True == 1.0), strings (float("5") == 5.0).
    "bool cap param": ((q, k, v), {"cap_method": "tanh", "cap_params": (True,)},
                       TypeError, "must be a static Python float, got bool"),
    "string cap param": ((q, k, v), {"cap_method": "tanh", "cap_params": ("5",)},
                         TypeError, "must be a static Python float, got str"),
    "string cap params": ((q, k, v), {"cap_method": "tanh", "cap_params": "5"},
                          TypeError, "cap_params must be a sequence of floats"),
    "string sm_scale": ((q, k, v), {"sm_scale": "0.5"}, TypeError, "sm_scale must be a float"),
    "string z-loss": ((q, k, v), {"z_loss_weight": "1"}, TypeError,
                      "z_loss_weight must be a float"),
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


# The arguments of queries and keys of different lengths, offsets and sinks
# (docs/SEMANTICS.md), which the reference takes.
SEG = jnp.zeros((B, T), jnp.int32)
BAD_REFERENCE = {
    "kv segments without segments": ((q, k, v), {"kv_segment_ids": SEG}, ValueError,
                                     "kv_segment_ids needs segment_ids"),
    "Tq != Tk segments without kv": ((q, k[:, :4], v[:, :4]), {"segment_ids": SEG}, ValueError,
                                     "need kv_segment_ids"),
    "kv segment shape": ((q, k[:, :4], v[:, :4]), {"segment_ids": SEG, "kv_segment_ids": SEG},
                         ValueError, r"kv_segment_ids must have shape \[B, Tk\]"),
    "kv segment dtype": ((q, k, v), {"segment_ids": SEG, "kv_segment_ids": SEG * 1.0},
                         TypeError, "kv_segment_ids must have an integer dtype"),
    "float q_offset": ((q, k, v), {"q_offset": 1.0}, TypeError, "q_offset must be an int"),
    "bool q_offset": ((q, k, v), {"q_offset": True}, TypeError, "q_offset must be an int"),
    "q_offset of a float array": ((q, k, v), {"q_offset": jnp.float32(1)}, TypeError,
                                  "q_offset must be an int"),
    "q_offset not a scalar": ((q, k, v), {"q_offset": jnp.zeros((2,), jnp.int32)}, ValueError,
                              "q_offset must be a scalar"),
    "q_offset past 2^30": ((q, k, v), {"q_offset": 1 << 31}, ValueError, "within"),
    "sinks shape": ((q, k, v), {"sinks": jnp.zeros((H + 1,))}, ValueError,
                    r"sinks must have shape \[Hq\]"),
    "sinks dtype": ((q, k, v), {"sinks": jnp.zeros((H,), jnp.int32)}, TypeError,
                    "sinks must have a floating dtype"),
    "sinks not an array": ((q, k, v), {"sinks": [0.0] * H}, TypeError, "sinks must be an array"),
}


@pytest.mark.parametrize("name", sorted(BAD_REFERENCE))
def test_bad_input_of_the_new_arguments_raises(name):
  args, kwargs, error, message = BAD_REFERENCE[name]
  with pytest.raises(error, match=message):
    ua_reference.attention(*args, **kwargs)


@pytest.mark.parametrize("name", sorted(BAD_REFERENCE))
def test_the_kernels_refuse_the_same_bad_input(name):
  args, kwargs, error, message = BAD_REFERENCE[name]
  with pytest.raises(error, match=message):
    ua_kernels.attention(*args, **kwargs)


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
    ({"num_warps": True}, ValueError, "num_warps"),
    ({"num_warps_bwd": 4.0}, ValueError, "num_warps_bwd"),
    ({"num_stages": 0}, ValueError, "num_stages"),
    ({"interpret": "yes"}, TypeError, "interpret"),
])
def test_kernel_config_errors(kwargs, error, message):
  with pytest.raises(error, match=message):
    KernelConfig(**kwargs)


def test_kernels_reject_non_config():
  with pytest.raises(TypeError, match="config must be a KernelConfig"):
    ua_kernels.attention(q, k, v, config={"block_q": 16})


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_a_window_beyond_int32_is_no_window(impl):
  """window_len only bounds how far back a query sees: any window of at least
  T hides nothing. Near 2^31 the kernels' tile bounds (start + window_len)
  wrapped in int32 and dk, dv came out 0; from 2^31 a jitted call overflowed."""
  import jax
  fn = IMPLS[impl]
  for causal in (False, True):
    loss = lambda window: lambda q, k, v: jnp.sum(
        fn(q, k, v, causal=causal, window_len=window) ** 2)
    want = jax.grad(loss(0), argnums=(0, 1, 2))(q, k, v)
    for window in (T, 2 ** 31 - 1, 2 ** 40):
      got = jax.grad(loss(window), argnums=(0, 1, 2))(q, k, v)
      for name, g, w in zip(("dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}, window {window}, causal {causal}")


@pytest.mark.parametrize("impl", sorted(IMPLS))
def test_segment_ids_wider_than_int32_keep_their_documents_apart(impl):
  """Any integer dtype, any values: 0 and 2^32 are two documents (a cast to
  int32 made them one), and the order of wide ids is kept."""
  fn = IMPLS[impl]
  narrow = np.repeat(np.array([[0, 1]]), T // 2, axis=1).repeat(B, 0)
  for wide in (narrow.astype(np.int64) * 2 ** 32, narrow.astype(np.uint64) * 2 ** 40 + 7,
               np.where(narrow == 1, np.iinfo(np.int64).max, np.iinfo(np.int64).min)):
    np.testing.assert_array_equal(np.asarray(fn(q, k, v, segment_ids=wide, causal=True)),
                                  np.asarray(fn(q, k, v, segment_ids=narrow, causal=True)))


def test_second_order_gradients_raise_a_clear_error():
  f = lambda q: ua_kernels.attention(q, k, v, causal=True).sum()
  assert np.isfinite(np.asarray(jax.grad(f)(q))).all()
  with pytest.raises(NotImplementedError, match="second-order gradients"):
    jax.grad(lambda q: jax.grad(f)(q).sum())(q)
