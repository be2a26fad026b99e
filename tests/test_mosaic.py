"""The Mosaic GPU kernels (ua_kernels/mosaic/forward.py, backward.py).

Their numerics need a Hopper GPU: there the kernel tests below compare them
with the Triton kernels, and the suite verifies them as their own implementation
(``ua-verify --impl ua_kernels.backends:mosaic_attention --profile gpu``,
docs/VERIFICATION.md). Without one (CI), every supported shape class is
lowered for CUDA, through Mosaic GPU's whole lowering to its MLIR module: a
dtype, shape, layout or shared-memory error of the kernel fails here.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ua_kernels
from ua_kernels import KernelConfig, MosaicTiles, devices
from ua_kernels.attention import _is_hopper, backends_for
from ua_kernels.mosaic import backward as mosaic_backward
from ua_kernels.mosaic import forward as mosaic_forward
from ua_kernels.tuned_configs import effective_config
from ua_reference.contract import validate, validate_call

MOSAIC = KernelConfig(backend="mosaic")

# (B, T, Hq, Hkv, D, dtype, options): every feature, each head dim class,
# lengths off the 128-row tile, GQA and MQA.
SHAPE_CLASSES = [
    (1, 256, 2, 2, 64, jnp.bfloat16, {}),
    (2, 384, 4, 2, 128, jnp.bfloat16, dict(causal=True)),
    (1, 200, 4, 1, 128, jnp.float16, dict(causal=True, window_len=37)),
    (1, 512, 2, 2, 256, jnp.bfloat16, dict(causal=True, cap_method="tanh", cap_params=(30.0,))),
    (1, 300, 2, 2, 80, jnp.float16, dict(cap_method="tanh", cap_params=(5.0,))),
    (2, 129, 8, 2, 64, jnp.bfloat16, dict(segment_ids=True, temperature=True, window_len=64)),
    (1, 256, 2, 1, 128, jnp.bfloat16, dict(cap_method="asym_tanh", cap_params=(2.0, 1.0))),
    (1, 256, 2, 2, 192, jnp.float16, dict(cap_method="hard", cap_params=(4.0,), sm_scale=-0.1)),
    (1, 100, 2, 2, 128, jnp.bfloat16, dict(cap_method="tanh", cap_params=(1000.0,))),
    (1, 1, 2, 2, 32, jnp.bfloat16, dict(causal=True, z_loss_weight=0.5)),
    # Packed documents (three of about T/3 positions each).
    (2, 300, 4, 2, 64, jnp.bfloat16, dict(segment_ids=True, causal=True)),
    (1, 520, 2, 2, 128, jnp.float16, dict(segment_ids=True, window_len=100)),
    # Two ids alternating in runs of the given length, unpadded lengths: the
    # tiles inside one run run unmasked, and each id's extent holds the
    # other's runs.
    (1, 512, 2, 2, 64, jnp.bfloat16, dict(segment_ids=128)),
    (2, 512, 4, 2, 128, jnp.float16, dict(segment_ids=96, causal=True)),
    # The halves kernels (head dim above 128) on packed documents, padding,
    # GQA and temperature.
    (1, 300, 4, 2, 256, jnp.bfloat16, dict(segment_ids=True, causal=True, temperature=True)),
]


def _arguments(b, t, hq, hkv, d, dtype, options):
  options = dict(options)
  extra = {}
  if options.pop("segment_ids", False):
    extra["segment_ids"] = jax.ShapeDtypeStruct((b, t), jnp.int32)
  if options.pop("temperature", False):
    extra["temperature"] = jax.ShapeDtypeStruct((b, t, hq), jnp.float32)
  if options.pop("sinks", False):
    extra["sinks"] = jax.ShapeDtypeStruct((hq,), jnp.float32)
  q = jax.ShapeDtypeStruct((b, t, hq, d), dtype)
  kv = jax.ShapeDtypeStruct((b, t, hkv, d), dtype)
  return (q, kv, kv), extra, options


def _lowered_text(fn, args, extra):
  return jax.jit(fn).trace(*args, **extra).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}-"
                         f"{jnp.dtype(c[5]).name}-{'-'.join(sorted(c[6])) or 'plain'}")
def test_forward_lowers_for_cuda(shape_class):
  args, extra, options = _arguments(*shape_class)

  def forward(q, k, v, **extra):
    return ua_kernels.attention(q, k, v, config=MOSAIC, return_lse=True, **options, **extra)

  text = _lowered_text(forward, args, extra)
  assert text.count("mosaic_gpu") >= 1, "the forward did not lower to a Mosaic GPU kernel"
  assert "ua_forward_mosaic" in text


@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}-"
                         f"{jnp.dtype(c[5]).name}-{'-'.join(sorted(c[6])) or 'plain'}")
def test_backward_lowers_for_cuda(shape_class):
  """The gradient of every shape class: the Mosaic dq and dk/dv kernels (above
  head dim 128 the ones that split the gradients' columns between warpgroups)
  compiled, interpret=False: not the interpreter of this CPU, after the Mosaic
  forward."""
  args, extra, options = _arguments(*shape_class)
  config = dataclasses.replace(MOSAIC, interpret=False)

  def loss(q, k, v, **extra):
    out, lse = ua_kernels.attention(q, k, v, config=config, return_lse=True, **options, **extra)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2)), args, extra)
  assert "ua_forward_mosaic" in text
  halves = "_halves" if shape_class[4] > mosaic_backward.HALVES_ABOVE else ""
  for kernel in ("ua_backward_dq", "ua_backward_dkv"):
    assert f"{kernel}{halves}_mosaic" in text


# The fused backward (deterministic=False, or ordered; bfloat16, head dims to 128): GQA under a
# causal mask, packed documents with temperature and a window on a padded length, a cap whose ds
# is rounded without bias (tests/test_mosaic_interpret.py runs the same classes, the first two
# ordered).
FUSED_CLASSES = [SHAPE_CLASSES[i] for i in (1, 5, 6)]
# The deterministic backward as the fused kernel, its adds in key-tile order.
ORDERED = KernelConfig(backend="mosaic", mosaic=MosaicTiles(ordered_fused=True))


@pytest.mark.parametrize("ordered", [False, True], ids=["any-order", "ordered"])
@pytest.mark.parametrize("shape_class", FUSED_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_fused_backward_lowers_for_cuda(shape_class, ordered):
  """deterministic=False, or MosaicTiles.ordered_fused: the gradient is one
  Mosaic kernel, dkv_dq_kernel, in place of the dq and dk/dv kernels (jax 0.10
  names a kernel that takes a ref new_body, not its kernel_name); ordered, its
  turns are semaphores in global memory."""
  args, extra, options = _arguments(*shape_class)
  config = dataclasses.replace(ORDERED if ordered else MOSAIC, interpret=False)

  def loss(q, k, v, **extra):
    out = ua_kernels.attention(q, k, v, config=config, deterministic=ordered, **options,
                               **extra)
    return jnp.sum(out.astype(jnp.float32))

  text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2)), args, extra)
  name = "ua_backward_fused_ordered_mosaic" if ordered else "ua_backward_fused_mosaic"
  assert f"{name}_mosaic_gpu" in text or "new_body_mosaic_gpu" in text
  assert "ua_backward_dq_mosaic" not in text and "ua_backward_dkv_mosaic" not in text
  # The forward's two results, and dq, dk, dv of the fused kernel and, ordered, its counters.
  results = sorted(int(n) for n in re.findall(r"%\d+:(\d+) = stablehlo.custom_call @mosaic_gpu",
                                              text))
  assert results == [2, 4 if ordered else 3], results
  if ordered:  # the counters come in zeroed at every call: one per (batch, head, query tile)
    call = re.search(r"%\d+:4 = stablehlo.custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    counters = call.group(1).split(",")[-1].strip()
    zeros = re.search(re.escape(counters) + r" = stablehlo.broadcast_in_dim (%\w+), .*"
                      r"tensor<(\d+)xi32>", text)
    assert re.search(re.escape(zeros.group(1)) + r" = stablehlo.constant dense<0> : tensor<i32>",
                     text), counters
    b, t, hq = shape_class[0], shape_class[1], shape_class[2]
    seq_pad = -(-t // 128) * 128  # the tuned tiles': programs of 2 x 64 rows, 128-key dq tiles
    assert int(zeros.group(2)) == b * hq * seq_pad // 64, zeros.group(0)


def test_the_fused_backward_runs_where_it_can():
  """bfloat16 at head dims up to 128 whose shared memory fits; elsewhere the
  other kernels, whose reruns are bitwise identical anyway; asked for where it
  cannot run, mosaic.backward refuses by name."""
  spec = _spec()
  fused = functools.partial(backends_for, deterministic=False)
  assert fused(spec, MOSAIC, jnp.bfloat16) == ("mosaic", "mosaic_fused")
  assert backends_for(spec, MOSAIC, jnp.bfloat16) == ("mosaic", "mosaic")
  assert fused(_spec(jnp.float16), MOSAIC, jnp.float16).backward == "mosaic"
  assert fused(_spec(d=256), MOSAIC, jnp.bfloat16).backward == "mosaic"
  assert fused(spec, KernelConfig(backend="triton"), jnp.bfloat16).backward == "triton"
  three_stages = KernelConfig(backend="mosaic", mosaic=MosaicTiles(stages_bwd=3))
  tiles = effective_config(spec, jnp.bfloat16, three_stages).mosaic
  assert "shared memory" in mosaic_backward.fused_unsupported(spec, jnp.bfloat16, tiles)
  assert fused(spec, three_stages, jnp.bfloat16).backward == "mosaic"
  assert backends_for(spec, ORDERED, jnp.bfloat16) == ("mosaic", "mosaic_fused_ordered")
  assert fused(spec, ORDERED, jnp.bfloat16).backward == "mosaic_fused"
  assert backends_for(_spec(jnp.float16), ORDERED, jnp.float16).backward == "mosaic"
  x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(TypeError, match="deterministic must be True or False"):
    ua_kernels.attention(x, x, x, deterministic=0)
  with pytest.raises(ValueError, match="ordered_fused must be a bool"):
    MosaicTiles(ordered_fused=1)
  rows = jnp.zeros((1, 2, 16), jnp.float32)
  x128 = jnp.zeros((1, 16, 2, 128), jnp.bfloat16)
  for inputs, tiles, match in ((x.astype(jnp.float16), MosaicTiles(), "float16"),
                               (x128, MosaicTiles(stages_bwd=3), "shared memory")):
    filled = effective_config(spec, jnp.bfloat16, KernelConfig(mosaic=tiles)).mosaic
    with pytest.raises(ValueError, match=match):
      mosaic_backward.backward(_spec(inputs.dtype, d=inputs.shape[-1]), filled, inputs, inputs,
                               inputs, None, None, rows, rows, inputs, fast_cap=False, fused=True)
  with pytest.raises(ValueError, match="needs fused=True"):
    mosaic_backward.backward(spec, filled, x, x, x, None, None, rows, rows, x, fast_cap=False,
                             ordered=True)


def test_the_fused_backward_takes_vmap():
  """jax.vmap of the gradient: the mapped axis folded into the batch
  (mosaic.common.batch_folded), since the fused kernel's pl.run_state has no
  batching rule; the folding itself against a plain vmap."""
  from ua_kernels.mosaic.common import batch_folded

  def f(a, b, c):
    return a * b[:, None] + 1.0, c.sum(axis=1)

  rng = np.random.default_rng(0)
  a, c = (jnp.asarray(rng.normal(size=(3, 2, 4, 5))) for _ in range(2))
  b = jnp.asarray(rng.normal(size=(2, 5)))
  for got, want in zip(jax.vmap(batch_folded(f), in_axes=(0, None, 0))(a, b, c),
                       jax.vmap(f, in_axes=(0, None, 0))(a, b, c)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert batch_folded(lambda x, none: (x + 1,))(a[0], None)[0].shape == a[0].shape
  args, extra, options = _arguments(*FUSED_CLASSES[0])
  config = dataclasses.replace(MOSAIC, interpret=False)

  def loss(q, k, v):
    out = ua_kernels.attention(q, k, v, config=config, deterministic=False, **options)
    return jnp.sum(out.astype(jnp.float32))

  q, k, v = args
  mapped = lambda x: jax.ShapeDtypeStruct((3, *x.shape), x.dtype)
  text = _lowered_text(jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=(0, 0, None)),
                       (mapped(q), mapped(k), v), {})
  assert "ua_backward_fused_mosaic_mosaic_gpu" in text or "new_body_mosaic_gpu" in text


# Sinks: causal with GQA and a cap (whose 16-bit rounded row sum takes the sink too), and packed
# documents with temperature (the persistent forward, whose programs take items of every head).
SINK_CLASSES = [
    (1, 200, 4, 2, 64, jnp.bfloat16, dict(causal=True, sinks=True, cap_method="tanh",
                                          cap_params=(5.0,))),
    (2, 129, 4, 1, 128, jnp.float16, dict(segment_ids=True, temperature=True, sinks=True)),
]


@pytest.mark.parametrize("shape_class", SINK_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_sinks_lower_to_the_mosaic_kernels(shape_class):
  """A call with sinks runs the Mosaic forward (the sink joins each row's mass
  at the end of its key loop) and the Mosaic backward, which the sinks leave
  as it is: they reach it through lse and delta only."""
  args, extra, options = _arguments(*shape_class)

  def loss(q, k, v, sinks, **extra):
    out, lse = ua_kernels.attention(q, k, v, config=MOSAIC, return_lse=True, sinks=sinks,
                                    **options, **extra)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  sinks = extra.pop("sinks")
  text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2, 3)), (*args, sinks), extra)
  for kernel in ("ua_forward_mosaic", "ua_backward_dq_mosaic", "ua_backward_dkv_mosaic"):
    assert kernel in text


# Keys of another length and offsets: a prefill against a longer cache (causal, GQA), rows
# before every key (a negative offset), a window past the queries' own length, a decode row
# with sinks, and equal lengths with an offset (as context_parallel's key blocks).
OTHER_KEYS_CLASSES = [
    (1, 100, 300, 4, 2, 64, jnp.bfloat16, dict(causal=True)),
    (2, 64, 200, 2, 2, 128, jnp.float16, dict(causal=True, q_offset=-10)),
    (1, 200, 129, 2, 1, 64, jnp.bfloat16, dict(window_len=50, q_offset=30, temperature=True)),
    (2, 1, 300, 4, 1, 128, jnp.bfloat16, dict(sinks=True, cap_method="tanh",
                                              cap_params=(5.0,))),
    (1, 256, 256, 2, 2, 64, jnp.float16, dict(causal=True, q_offset=70)),
]


def other_keys_inputs(shape_class, seed=0):
  """(q, k, v) and the keywords of an OTHER_KEYS_CLASSES call."""
  b, tq, tk, hq, hkv, d, dtype, options = shape_class
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype) for _ in range(2))
  options = dict(options)
  if options.pop("temperature", False):
    options["temperature"] = jnp.asarray(rng.uniform(0.5, 2.0, size=(b, tq, hq)), jnp.float32)
  if options.pop("sinks", False):
    options["sinks"] = jnp.asarray(rng.uniform(-1.0, 4.0, size=(hq,)), jnp.float32)
  return (q, k, v), options


def _other_keys_id(c):
  return f"Tq{c[1]}-Tk{c[2]}-D{c[5]}-{'-'.join(sorted(c[7])) or 'plain'}"


@pytest.mark.parametrize("shape_class", OTHER_KEYS_CLASSES, ids=_other_keys_id)
def test_other_keys_lower_to_the_mosaic_forward(shape_class):
  """Keys of another length or an offset run the Mosaic forward when asked
  for (the offset traced: one compile serves every offset); their backward
  runs on Triton (backends_for)."""
  (q, k, v), options = other_keys_inputs(shape_class)
  forward = lambda q, k, v: ua_kernels.attention(q, k, v, config=MOSAIC, return_lse=True,
                                                 **options)
  text = _lowered_text(forward, (q, k, v), {})
  assert "ua_forward_mosaic" in text
  spec = validate_call(q, k, v, **options).spec
  assert backends_for(spec, MOSAIC, q.dtype) == ("mosaic", "triton")
  # "auto" keeps them on Triton until they have run compiled (docs/SEMANTICS.md).
  assert backends_for(spec, KernelConfig(), q.dtype).forward == "triton"


def test_segment_ids_with_other_keys_are_refused_by_the_mosaic_forward():
  x = jnp.zeros((1, 64, 2, 64), jnp.bfloat16)
  ids = jnp.zeros((1, 64), jnp.int32)
  with pytest.raises(ValueError, match="segment ids with keys of another length or offset"):
    ua_kernels.attention(x, x, x, segment_ids=ids, q_offset=3, config=MOSAIC)
  spec = validate(x, x, x, segment_ids=ids)[0]
  with pytest.raises(ValueError, match="segment ids only with the queries' own keys"):
    mosaic_forward.forward(spec, MosaicTiles(block_q=64, block_kv=64, stages=2), x, x, x, ids,
                           None, fast_cap=False, offset=jnp.int32(3))


def test_a_key_block_without_segment_ids_lowers_to_the_mosaic_forward():
  """attention_block (context_parallel's pairs) with the Mosaic forward asked
  for: a window across the block's edge, the offset traced."""
  from ua_kernels.attention import attention_block
  x = jax.ShapeDtypeStruct((1, 128, 2, 64), jnp.bfloat16)
  block = lambda q, k, v, offset: attention_block(q, k, v, offset=offset, causal=True,
                                                  window_len=40, config=MOSAIC)
  text = _lowered_text(block, (x, x, x, jax.ShapeDtypeStruct((), jnp.int32)), {})
  assert "ua_forward_mosaic" in text


def test_shared_memory_overflow_is_a_lowering_error():
  """Tiles too large for the 227 KiB of shared memory fail at lowering, with
  Mosaic's message, not at run time."""
  args, extra, _ = _arguments(1, 512, 2, 2, 256, jnp.bfloat16, {})
  config = KernelConfig(backend="mosaic", mosaic=MosaicTiles(block_kv=256, stages=4))
  with pytest.raises(ValueError, match="shared memory"):
    _lowered_text(lambda q, k, v: ua_kernels.attention(q, k, v, config=config), args, extra)


# Backward tiles at head dim 256: the defaults, then ones that pass MosaicTiles'
# validation but exceed a block's shared memory in the halves kernels.
HALVES_TILES = [MosaicTiles(), MosaicTiles(block_kv_dq=64), MosaicTiles(block_q_dq=128),
                MosaicTiles(block_kv_dkv=128), MosaicTiles(block_q_dkv=128),
                MosaicTiles(stages_bwd=3)]


@pytest.mark.parametrize("tiles", HALVES_TILES, ids=repr)
def test_halves_shared_memory_estimate_matches_lowering(tiles):
  """mosaic_backward.halves_shared_memory decides whether the dispatch runs
  the backward on Mosaic at head dims above 128; Mosaic's lowering agrees:
  the tiles it rejects overflow there, the ones it accepts lower."""
  b, t, h, d = 1, 256, 2, 256
  spec = _spec(d=d)
  config = KernelConfig(backend="mosaic", mosaic=tiles)
  tiles = effective_config(spec, jnp.bfloat16, config).mosaic
  x = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  rows = jax.ShapeDtypeStruct((b, h, t), jnp.float32)

  def gradients(q, k, v, lse2, delta, dout):
    return mosaic_backward.backward(spec, tiles, q, k, v, None, None, lse2, delta, dout,
                                    fast_cap=False)

  fits = mosaic_backward.unsupported(spec, jnp.bfloat16, tiles) is None
  assert fits == (mosaic_backward.halves_shared_memory(tiles, 2) <= 232448)
  assert backends_for(spec, config, jnp.bfloat16).backward == ("mosaic" if fits else "triton")
  lower = lambda: _lowered_text(gradients, (x, x, x, rows, rows, x), {})
  if fits:
    assert "ua_backward_dq_halves_mosaic" in lower()
  else:
    with pytest.raises(ValueError, match="shared memory"):
      lower()


def test_tiles_too_large_for_the_halves_kernels_run_the_backward_on_triton():
  """Such tiles ran the backward on Triton before the halves kernels existed;
  they still do, after the Mosaic forward."""
  args, extra, _ = _arguments(1, 256, 2, 2, 256, jnp.bfloat16, {})
  config = KernelConfig(backend="mosaic", mosaic=MosaicTiles(block_q_dq=128), interpret=False)

  def loss(q, k, v):
    return ua_kernels.attention(q, k, v, config=config).astype(jnp.float32).sum()

  spec = _spec(d=256)
  assert backends_for(spec, config, jnp.bfloat16).backward == "triton"
  try:
    text = _lowered_text(jax.grad(loss, argnums=(0, 1, 2)), args, extra)
  except RuntimeError as error:
    if "No supported GPU devices" not in str(error):
      raise
    pytest.skip("from jax 0.11 the Triton kernels lower for CUDA only on a GPU machine")
  assert "ua_forward_mosaic" in text and "ua_backward_dq" in text
  assert "_halves_mosaic" not in text


def _spec(dtype=jnp.bfloat16, d=128, **options):
  x = jnp.zeros((1, 16, 2, d), dtype)
  return validate(x, x, x, **options)[0]


def test_dispatch():
  spec = _spec()
  assert backends_for(spec, KernelConfig(backend="triton"), jnp.bfloat16).forward == "triton"
  assert backends_for(spec, MOSAIC, jnp.bfloat16).forward == "mosaic"
  # The backward follows the forward, up to the Mosaic backward's head dims.
  assert backends_for(spec, MOSAIC, jnp.bfloat16).backward == "mosaic"
  assert backends_for(_spec(d=256), MOSAIC, jnp.bfloat16).backward == "mosaic"
  assert backends_for(_spec(d=320), KernelConfig(), jnp.bfloat16).backward == "triton"
  assert backends_for(spec, KernelConfig(backend="triton"), jnp.bfloat16).backward == "triton"
  # Sinks run on Mosaic when asked for; "auto" keeps them on Triton (docs/SEMANTICS.md).
  with_sinks = dataclasses.replace(spec, has_sinks=True)
  assert backends_for(with_sinks, MOSAIC, jnp.bfloat16) == ("mosaic", "mosaic")
  assert backends_for(with_sinks, KernelConfig(), jnp.bfloat16).forward == "triton"
  # Without a Hopper GPU (here: the interpreter) "auto" is Triton.
  if not _is_hopper():
    assert backends_for(spec, KernelConfig(), jnp.bfloat16).forward == "triton"
  else:
    assert backends_for(spec, KernelConfig(), jnp.bfloat16).forward == "mosaic"
    assert backends_for(spec, KernelConfig(), jnp.float32).forward == "triton"
    assert backends_for(_spec(segment_ids=jnp.zeros((1, 16), jnp.int32)), KernelConfig(),
                        jnp.bfloat16).forward == "mosaic"


@pytest.mark.parametrize("dtype, d, match", [(jnp.float32, 128, "bfloat16 and float16"),
                                             (jnp.bfloat16, 320, "head dims up to 256")])
def test_forcing_mosaic_where_it_cannot_run_is_an_error(dtype, d, match):
  x = jnp.zeros((1, 16, 2, d), dtype)
  with pytest.raises(ValueError, match=match):
    ua_kernels.attention(x, x, x, config=MOSAIC)


def test_forcing_mosaic_in_the_interpreter_is_an_error():
  x = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="interpret"):
    ua_kernels.attention(x, x, x, config=KernelConfig(backend="mosaic", interpret=True))


@pytest.mark.parametrize("field, value", [("block_q", 32), ("block_q", 256), ("block_kv", 96),
                                          ("stages", 1), ("block_kv", True), ("stages_bwd", 1),
                                          ("block_q_dq", 32), ("block_kv_dkv", 256),
                                          ("block_kv_dq", 256), ("block_q_dkv", "64"),
                                          ("block_q", 64.0)])
def test_mosaic_tiles_are_validated(field, value):
  with pytest.raises(ValueError, match=f"MosaicTiles.{field}"):
    MosaicTiles(**{field: value})


def test_backend_is_validated():
  with pytest.raises(ValueError, match="KernelConfig.backend"):
    KernelConfig(backend="cuda")
  with pytest.raises(TypeError, match="KernelConfig.mosaic"):
    KernelConfig(mosaic=(64, 128))


def _gpu_inputs(shape_class, seed=0):
  """Concrete inputs of a shape class: (q, k, v), the keyword inputs, the options."""
  args, extra, options = _arguments(*shape_class)
  rng = np.random.default_rng(seed)
  q, k, v = (jnp.asarray(rng.normal(size=a.shape), a.dtype) for a in args)
  inputs = {}
  if "segment_ids" in extra:
    b, t = extra["segment_ids"].shape
    layout = shape_class[6]["segment_ids"]
    ids = (np.sort(rng.integers(0, 3, size=(b, t))) if layout is True
           else np.broadcast_to((np.arange(t) // layout) % 2, (b, t)))
    inputs["segment_ids"] = jnp.asarray(ids, jnp.int32)
  if "temperature" in extra:
    inputs["temperature"] = jnp.asarray(rng.uniform(0.5, 2.0, size=extra["temperature"].shape),
                                        jnp.float32)
  if "sinks" in extra:  # near the rows' largest logits: a small share of the mass to most
    inputs["sinks"] = jnp.asarray(rng.uniform(-1.0, 4.0, size=extra["sinks"].shape), jnp.float32)
  return (q, k, v), inputs, options


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_mosaic_forward_matches_triton_forward(shape_class):
  """Compiled on Hopper: the Mosaic forward against the Triton one, the same
  logits and softmax in another kernel: out within a few 16-bit roundings, lse
  within float32 rounding of the logits."""
  _assert_forward_matches_triton(*_gpu_inputs(shape_class))


def _assert_forward_matches_triton(qkv, inputs, options):
  """The Mosaic forward's out within four 16-bit roundings of the largest |v|
  of the Triton forward's, its lse within float32 rounding of the logits."""
  q, k, v = qkv
  run = lambda backend: ua_kernels.attention(q, k, v, return_lse=True,
                                             config=KernelConfig(backend=backend),
                                             **options, **inputs)
  (out_m, lse_m), (out_t, lse_t) = run("mosaic"), run("triton")
  eps = float(jnp.finfo(q.dtype).eps)
  np.testing.assert_allclose(np.asarray(out_m, np.float32), np.asarray(out_t, np.float32),
                             atol=4 * eps * float(jnp.max(jnp.abs(v))), rtol=0)
  np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse_t), rtol=1e-5, atol=1e-5)


# Packed documents without a band run the persistent forward (mosaic.tuned.mosaic_tiles):
# documents of about T/3 and alternating runs of 128, dealt to 5 programs (several items each,
# not all as many) and to the GPU's own count (512 items); at head dim 256 O leaves through
# Q's buffer.
PACKED_PERSISTENT_CLASSES = [
    (3, 300, 2, 1, 64, jnp.bfloat16, dict(segment_ids=True), 5),
    (1, 512, 3, 3, 128, jnp.float16, dict(segment_ids=128, temperature=True), 5),
    (1, 300, 4, 2, 256, jnp.bfloat16, dict(segment_ids=True, temperature=True), 5),
    (4, 1024, 16, 2, 128, jnp.bfloat16, dict(segment_ids=True), None),
]


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", PACKED_PERSISTENT_CLASSES,
                         ids=lambda c: f"B{c[0]}-T{c[1]}-D{c[4]}-programs{c[7]}")
def test_the_persistent_forward_over_packed_documents_matches_triton(shape_class, monkeypatch):
  """Compiled on Hopper, the table's config (persistent) against the Triton
  forward, as test_mosaic_forward_matches_triton_forward does."""
  *shape_class, programs = shape_class
  asked = []
  if programs is not None:
    monkeypatch.setattr(devices, "multiprocessors", lambda: asked.append(1) or programs)
  # A call traced before with the same shapes would reuse its program count.
  jax.clear_caches()
  qkv, inputs, options = _gpu_inputs(tuple(shape_class))
  spec = validate(*qkv, **options, **inputs)[0]
  assert effective_config(spec, qkv[0].dtype).mosaic.persistent
  try:
    _assert_forward_matches_triton(qkv, inputs, options)
  finally:
    jax.clear_caches()  # no later test reuses the patched program count
  assert programs is None or asked, "the forward did not ask for its program count"


def _gradients(fn, q, k, v, inputs, options, seed=1):
  """dq, dk, dv of a loss that weighs out and lse by fixed random cotangents."""
  def loss(q, k, v):
    out, lse = fn(q, k, v, return_lse=True, **options, **inputs)
    rng = np.random.default_rng(seed)
    d_out = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    d_lse = jnp.asarray(rng.normal(size=lse.shape), jnp.float32)
    return (jnp.sum(out.astype(jnp.float32) * d_out)
            + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse))
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", SHAPE_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_mosaic_gradients_are_as_close_to_the_reference_as_triton_ones(shape_class):
  """Compiled on Hopper: each gradient of the Mosaic backend, against the
  float32 reference, within twice the Triton backend's largest error (the same
  math in other tile orders and roundings) plus one 16-bit rounding of the
  gradient's scale. A wrong mask, tile range or missing term errs by the size
  of the gradient itself."""
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  _assert_gradients_as_close_as_triton(q, k, v, inputs, options)


def _assert_gradients_as_close_as_triton(q, k, v, inputs, options, deterministic=True):
  """dq, dk, dv of the Mosaic backend against the float32 reference, each as
  _assert_as_close_as_triton holds it."""
  import ua_reference
  upcast = [x.astype(jnp.float32) for x in (q, k, v)]
  reference = _gradients(ua_reference.attention, *upcast, inputs, options)
  run = lambda backend, **kw: _gradients(
      functools.partial(ua_kernels.attention, config=KernelConfig(backend=backend), **kw),
      q, k, v, inputs, options)
  mosaic = run("mosaic", deterministic=deterministic)
  for name, m, t, r in zip(("dq", "dk", "dv"), mosaic, run("triton"), reference):
    _assert_as_close_as_triton(name, m, t, r, q.dtype)


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", FUSED_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_fused_backward_is_as_close_to_the_reference_as_triton(shape_class):
  """Compiled on Hopper, deterministic=False: the fused backward's gradients
  as test_mosaic_gradients_are_as_close_to_the_reference_as_triton_ones holds
  the other kernels'."""
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  spec = validate(q, k, v, **options, **inputs)[0]
  assert backends_for(spec, MOSAIC, q.dtype, deterministic=False).backward == "mosaic_fused"
  _assert_gradients_as_close_as_triton(q, k, v, inputs, options, deterministic=False)


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", FUSED_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_the_ordered_fused_backward_is_bitwise_reproducible(shape_class):
  """Compiled on Hopper, MosaicTiles.ordered_fused: two runs' gradients
  bitwise identical, and as close to the reference as
  test_the_fused_backward_is_as_close_to_the_reference_as_triton holds the
  unordered one's."""
  (q, k, v), inputs, options = _gpu_inputs(shape_class)
  spec = validate(q, k, v, **options, **inputs)[0]
  assert backends_for(spec, ORDERED, q.dtype).backward == "mosaic_fused_ordered"
  ordered = functools.partial(ua_kernels.attention, config=ORDERED)
  first, second = (_gradients(ordered, q, k, v, inputs, options) for _ in range(2))
  for name, a, b in zip(("dq", "dk", "dv"), first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  import ua_reference
  reference = _gradients(ua_reference.attention, *(x.astype(jnp.float32) for x in (q, k, v)),
                         inputs, options)
  triton = _gradients(functools.partial(ua_kernels.attention,
                                        config=KernelConfig(backend="triton")),
                      q, k, v, inputs, options)
  for name, m, t, r in zip(("dq", "dk", "dv"), first, triton, reference):
    _assert_as_close_as_triton(name, m, t, r, q.dtype)


def _assert_as_close_as_triton(name, mosaic, triton, reference, dtype):
  """The Mosaic result's largest error against ``reference`` within twice the
  Triton one's plus one rounding of ``dtype`` at the reference's scale."""
  m, t, r = (np.asarray(x, np.float32) for x in (mosaic, triton, reference))
  err_m, err_t = np.max(np.abs(m - r)), np.max(np.abs(t - r))
  bound = 2 * err_t + float(jnp.finfo(dtype).eps) * np.max(np.abs(r))
  assert err_m <= bound, f"{name}: Mosaic error {err_m:.3g}, Triton {err_t:.3g}"


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", SINK_CLASSES, ids=lambda c: f"T{c[1]}-D{c[4]}")
def test_mosaic_with_sinks_matches_triton(shape_class):
  """Compiled on Hopper, with sinks: the forward as
  test_mosaic_forward_matches_triton_forward holds it, and d sinks within
  twice the Triton backend's error against the float32 reference plus one
  16-bit rounding of its scale."""
  import ua_reference
  qkv, inputs, options = _gpu_inputs(shape_class)
  _assert_forward_matches_triton(qkv, inputs, options)

  def dsinks(fn, *qkv):
    def loss(sinks):
      out, lse = fn(*qkv, return_lse=True, **options, **dict(inputs, sinks=sinks))
      return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))
    return np.asarray(jax.grad(loss)(inputs["sinks"]))

  reference = dsinks(ua_reference.attention, *(x.astype(jnp.float32) for x in qkv))
  mosaic, triton = (dsinks(functools.partial(ua_kernels.attention,
                                             config=KernelConfig(backend=backend)), *qkv)
                    for backend in ("mosaic", "triton"))
  _assert_as_close_as_triton("d sinks", mosaic, triton, reference, qkv[0].dtype)


@pytest.mark.skipif(not _is_hopper(), reason="the Mosaic kernel runs on Hopper (sm90) only")
@pytest.mark.parametrize("shape_class", OTHER_KEYS_CLASSES, ids=_other_keys_id)
def test_mosaic_forward_of_other_keys_matches_triton(shape_class):
  """Compiled on Hopper, keys of another length or an offset: out and lse as
  test_mosaic_forward_matches_triton_forward holds them (rows without a key
  exactly 0 and -inf), and the gradients (the Triton backward on the Mosaic
  forward's residuals) as test_mosaic_gradients_are_as_close_to_the_reference_as_triton_ones."""
  (q, k, v), options = other_keys_inputs(shape_class)
  _assert_forward_matches_triton((q, k, v), {}, options)
  _assert_gradients_as_close_as_triton(q, k, v, {}, options)


def test_backend_implementations_declare_what_they_run():
  """ua_kernels.backends as the suite loads them: the Mosaic one 16-bit and
  head dims up to 256 only, the fused one up to 128 and its reruns not bitwise
  identical; the Triton one everything, its config forced to
  Triton; on this CPU the Triton one computes what the dispatching op does."""
  from properties.model.capabilities import load_impl

  mosaic = load_impl("ua_kernels.backends:mosaic_attention")
  assert mosaic.dtypes == ("bfloat16", "float16")
  assert mosaic.head_dims(256) and not mosaic.head_dims(320)
  assert mosaic.unsupported == {"kv_length", "q_offset", "kv_segment_ids"}
  fused = load_impl("ua_kernels.backends:fused_attention")
  assert fused.deterministic is False and mosaic.deterministic is True
  assert fused.head_dims(128) and not fused.head_dims(192)
  assert fused.unsupported == mosaic.unsupported
  ordered = load_impl("ua_kernels.backends:ordered_attention")
  assert ordered.deterministic is True and ordered.dtypes == fused.dtypes
  triton = load_impl("ua_kernels.backends:triton_attention")
  assert not triton.unsupported
  assert set(triton.dtypes) == {"float32", "bfloat16", "float16"}
  assert triton.config(16, 32).backend == "triton"
  rng = np.random.default_rng(1)
  q, k, v = (jnp.asarray(rng.normal(size=(1, 40, 2, 32)), jnp.float32) for _ in range(3))
  from ua_kernels.backends import triton_attention
  np.testing.assert_array_equal(np.asarray(triton_attention(q, k, v, causal=True)),
                                np.asarray(ua_kernels.attention(q, k, v, causal=True)))
