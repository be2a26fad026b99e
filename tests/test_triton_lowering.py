"""The Pallas-Triton decode forward (ua_kernels/triton/decode.py) lowered to
Triton's IR for an sm90 GPU on a machine without one: the lowering, where a
construct the interpreter runs but Triton cannot express fails, before a GPU
ever compiles it. jax 0.10.2 falls back to sm90 without a GPU; later ones ask
for the device's compute capability, which is patched here."""

import functools
import types

import jax
import jax.numpy as jnp
import pytest

import ua_kernels
from ua_kernels import KernelConfig


@pytest.fixture
def sm90(monkeypatch):
  from jax._src.pallas.triton import pallas_call_registration as registration
  info = getattr(registration, "gpu_info_lib", None)
  if info is not None:
    monkeypatch.setattr(info, "get_gpu_info",
                        lambda: types.SimpleNamespace(compute_capability="9.0"))


# (Tq, Tk, Hq, Hkv, D, dtype, options): GQA packed and split, MHA split, a
# window over float32, and every keyword the decode forward carries.
CASES = [
    (1, 32768, 32, 8, 128, jnp.bfloat16, {}),
    (8, 4096, 32, 32, 128, jnp.float16, dict(causal=True)),
    (4, 8192, 16, 2, 64, jnp.float32, dict(causal=True, window_len=300)),
    (3, 4096, 8, 2, 128, jnp.bfloat16, dict(sinks=True, segments=True, temperature=True,
                                            cap_method="tanh", cap_params=(30.0,))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Tq{c[0]}-Tk{c[1]}-H{c[2]}/{c[3]}-"
                         f"{jnp.dtype(c[5]).name}-{'-'.join(sorted(c[6])) or 'plain'}")
def test_the_decode_forward_lowers_for_sm90(sm90, case):
  tq, tk, hq, hkv, d, dtype, options = case
  options = dict(options)
  args = [jax.ShapeDtypeStruct((1, tq, hq, d), dtype)]
  args += [jax.ShapeDtypeStruct((1, tk, hkv, d), dtype)] * 2
  extra = {}
  if options.pop("sinks", False):
    extra["sinks"] = jax.ShapeDtypeStruct((hq,), jnp.float32)
  if options.pop("segments", False):
    extra["segment_ids"] = jax.ShapeDtypeStruct((1, tq), jnp.int32)
    extra["kv_segment_ids"] = jax.ShapeDtypeStruct((1, tk), jnp.int32)
  if options.pop("temperature", False):
    extra["temperature"] = jax.ShapeDtypeStruct((1, tq, hq), jnp.float32)
  fn = functools.partial(ua_kernels.attention, config=KernelConfig(interpret=False,
                                                                   backend="triton"), **options)
  text = jax.jit(fn).trace(*args, **extra).lower(lowering_platforms=("cuda",)).as_text()
  assert "ua_forward_decode" in text
