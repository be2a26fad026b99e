"""KernelConfig's unset fields are the tuned table's (ua_kernels.tuned_configs).

Choosing a backend chooses no tiles: KernelConfig(backend="triton") once
replaced the tuned tiles with the dataclass defaults, and on an H200 the Triton
backend ran at 252 TFLOP/s instead of its tuned ~450. These tests compare the
effective config of a call (tuned_configs.effective_config, and what
ua_kernels.attention hands its jitted kernels) with the table; no kernel runs.
"""

import dataclasses
import sys

import jax.numpy as jnp
import pytest

import ua_kernels
from ua_kernels import KernelConfig, MosaicTiles, backends
from ua_kernels.mosaic import backward as mosaic_backward
from ua_kernels.mosaic.tuned import PERSISTENT_MAX_SEQ_LEN
from ua_kernels.tuned_configs import (default_config, effective_config,
                                      mosaic_tiles, triton_config)
from ua_reference.contract import validate

attention_module = sys.modules["ua_kernels.attention"]

TRITON_FIELDS = ("block_q", "block_kv", "block_q_dq", "block_kv_dq", "block_q_dkv",
                 "block_kv_dkv", "num_warps", "num_stages", "num_warps_bwd", "num_stages_bwd",
                 "kv_splits", "pack_gqa")

# (head dim, dtype, options): each row of the table.
SHAPES = [
    (64, jnp.bfloat16, dict(causal=True)),
    (128, jnp.bfloat16, {}),
    (128, jnp.bfloat16, dict(cap_method="tanh", cap_params=(30.0,))),
    (96, jnp.float16, dict(causal=True, window_len=64)),
    (256, jnp.bfloat16, dict(causal=True)),
    (128, jnp.float32, {}),
    (256, jnp.float32, {}),
]


def _spec(d, dtype, options, t=256):
  x = jnp.zeros((1, t, 2, d), dtype)
  return validate(x, x, x, **options)[0]


def _tiles(config):
  return {name: getattr(config, name) for name in TRITON_FIELDS}, config.mosaic


@pytest.mark.parametrize("backend", ["triton", "mosaic", "auto"])
@pytest.mark.parametrize("d, dtype, options", SHAPES, ids=repr)
def test_forcing_a_backend_keeps_the_tuned_tiles(backend, d, dtype, options):
  spec = _spec(d, dtype, options)
  got = effective_config(spec, dtype, KernelConfig(backend=backend))
  assert got == dataclasses.replace(default_config(spec, dtype), backend=backend)
  assert _tiles(got) == (_tiles(triton_config(spec, dtype))[0], mosaic_tiles(spec, dtype))
  assert not got.unset()


def test_the_triton_tiles_of_the_regression():
  """Head dim 128, bfloat16, no cap: the tuned Triton forward takes 128 x 128
  tiles, 8 warps, 3 stages, where the dataclass defaults had 64 x 64."""
  spec = _spec(128, jnp.bfloat16, {})
  got = effective_config(spec, jnp.bfloat16, KernelConfig(backend="triton"))
  assert (got.block_q, got.block_kv, got.num_warps, got.num_stages) == (128, 128, 8, 3)
  assert got.backend == "triton"


def test_a_partial_config_keeps_what_is_given_and_takes_the_rest_from_the_table():
  spec = _spec(128, jnp.bfloat16, {})
  tuned = default_config(spec, jnp.bfloat16)
  given = KernelConfig(block_q=64, num_warps_bwd=2, backend="triton", interpret=True)
  got = effective_config(spec, jnp.bfloat16, given)
  assert (got.block_q, got.num_warps_bwd, got.backend, got.interpret) == (64, 2, "triton", True)
  assert got == dataclasses.replace(tuned, block_q=64, num_warps_bwd=2, backend="triton",
                                    interpret=True)
  assert tuned.block_q == 128  # the given value is not the table's


@pytest.mark.parametrize("d", [128, 256])
def test_partial_mosaic_tiles_take_the_rest_from_the_table(d):
  spec = _spec(d, jnp.bfloat16, dict(causal=True))
  given = KernelConfig(backend="mosaic", mosaic=MosaicTiles(block_q_dq=128, stages=3))
  got = effective_config(spec, jnp.bfloat16, given)
  tuned = default_config(spec, jnp.bfloat16)
  assert got.mosaic == dataclasses.replace(tuned.mosaic, block_q_dq=128, stages=3)
  assert got.mosaic.block_kv == (128 if d <= 128 else 64)
  assert _tiles(got)[0] == _tiles(tuned)[0]


def test_a_full_config_is_kept_as_it_is():
  spec = _spec(128, jnp.bfloat16, {})
  full = KernelConfig(32, 16, 16, 32, 32, 16, num_warps=2, num_stages=1, num_warps_bwd=4,
                      num_stages_bwd=2, kv_splits=1, pack_gqa=False, backend="triton",
                      mosaic=MosaicTiles(128, 64, 3, 128, 64, 128, 64, 3, False, True, False))
  assert not full.unset()
  assert effective_config(spec, jnp.bfloat16, full) is full


def test_effective_configs_are_idempotent_hashable_and_shared():
  """They key jit's cache: two spellings of one effective config are one key."""
  spec = _spec(64, jnp.bfloat16, {})
  got = effective_config(spec, jnp.bfloat16, KernelConfig(backend="triton"))
  assert effective_config(spec, jnp.bfloat16, got) == got
  explicit = effective_config(spec, jnp.bfloat16, KernelConfig(
      block_q=got.block_q, num_warps=got.num_warps, backend="triton"))
  assert explicit == got and hash(explicit) == hash(got)
  assert effective_config(spec, jnp.bfloat16, None) == default_config(spec, jnp.bfloat16)


@pytest.fixture
def captured(monkeypatch):
  """The configs ua_kernels.attention hands its jitted kernels (none run)."""
  configs = []

  def fake(spec, config, backends, q, k, v, seg, temp, keys=None, sinks=None):
    configs.append(config)
    return q, jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)

  monkeypatch.setattr(attention_module, "_jitted_attention", fake)
  return configs


@pytest.mark.parametrize("call, backend", [
    (lambda x, c: ua_kernels.attention(x, x, x, causal=True, config=c), None),
    (lambda x, c: backends.triton_attention(x, x, x, causal=True, config=c), "triton"),
    (lambda x, c: backends.mosaic_attention(x, x, x, causal=True, config=c), "mosaic"),
])
def test_every_entry_point_runs_the_effective_config(captured, call, backend):
  x = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
  spec = _spec(128, jnp.bfloat16, dict(causal=True))
  tuned = default_config(spec, jnp.bfloat16)
  for given in (None, KernelConfig(block_kv=32, mosaic=MosaicTiles(block_kv_dkv=128))):
    call(x, given)
    want = effective_config(spec, jnp.bfloat16, given)
    assert captured.pop() == dataclasses.replace(want, backend=backend or want.backend)
  assert want.block_kv == 32 and want.mosaic.block_kv_dkv == 128
  assert want.block_q == tuned.block_q and want.mosaic.block_q == tuned.mosaic.block_q


def test_unset_fields_are_none_and_validated_when_set():
  assert KernelConfig().unset() == TRITON_FIELDS + tuple(
      f"mosaic.{f.name}" for f in dataclasses.fields(MosaicTiles))
  assert MosaicTiles(block_q=128).unset() == ("block_kv", "stages", "block_q_dq", "block_kv_dq",
                                              "block_q_dkv", "block_kv_dkv", "stages_bwd",
                                              "persistent", "overlap_softmax",
                                              "ordered_fused")
  with pytest.raises(ValueError, match="MosaicTiles.persistent"):
    MosaicTiles(persistent=1)
  with pytest.raises(ValueError, match="MosaicTiles.overlap_softmax"):
    MosaicTiles(overlap_softmax="yes")
  with pytest.raises(ValueError, match="KernelConfig.block_q_dq"):
    KernelConfig(block_q_dq=48)
  with pytest.raises(TypeError, match="KernelConfig.block_kv"):
    KernelConfig(block_kv="64")
  with pytest.raises(ValueError, match="KernelConfig.num_stages_bwd"):
    KernelConfig(num_stages_bwd=0)
  with pytest.raises(ValueError, match="MosaicTiles.stages"):
    MosaicTiles(stages=True)


def test_the_forward_is_persistent_without_a_band_up_to_the_measured_length():
  """Persistent programs deal items round-robin, which idles multiprocessors
  where the items' work follows the query tile (causal, window); packed
  documents gained from it, and at 16k keys per-item grids were as fast
  (docs/BENCHMARKS.md)."""
  bf16 = jnp.bfloat16
  longest = PERSISTENT_MAX_SEQ_LEN
  ids = jnp.zeros((1, 1024), jnp.int32)
  assert mosaic_tiles(_spec(128, bf16, {}, t=longest), bf16).persistent is True
  assert mosaic_tiles(_spec(256, bf16, {}, t=1024), bf16).persistent is True
  assert mosaic_tiles(_spec(128, bf16, dict(segment_ids=ids), t=1024), bf16).persistent is True
  assert mosaic_tiles(_spec(128, bf16, {}, t=longest + 1), bf16).persistent is False
  for options in (dict(causal=True), dict(window_len=64),
                  dict(segment_ids=ids, causal=True), dict(segment_ids=ids, window_len=64)):
    assert mosaic_tiles(_spec(128, bf16, options, t=1024), bf16).persistent is False, options


def test_the_forward_overlaps_its_softmax_above_head_dim_64():
  """The overlapped forward gained at head dims 128 and 256 and lost at 64,
  persistent or not (docs/HISTORY.md, "The overlapped forward")."""
  bf16 = jnp.bfloat16
  for d, overlapped in ((64, False), (80, True), (128, True), (256, True)):
    for options in (dict(), dict(causal=True)):
      for t in (1024, 16384):
        tiles = mosaic_tiles(_spec(d, bf16, options, t=t), bf16)
        assert tiles.overlap_softmax is overlapped, (d, options, t)


def test_kernels_refuse_unfilled_tiles():
  """Internals take effective configs: an unset field is named, not a None in arithmetic."""
  with pytest.raises(ValueError, match="unset: block_q, block_kv"):
    mosaic_backward.halves_shared_memory(MosaicTiles(block_q_dq=128), 2)
  spec = _spec(64, jnp.float32, {})
  x = jnp.zeros((1, 256, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="unset: .*num_warps"):
    attention_module._forward(spec, KernelConfig(block_q=16, interpret=True),
                              attention_module.Backends("triton", "triton"), x, x, x, None, None)
