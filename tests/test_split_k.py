"""Split-K decode on Pallas-Triton (KernelConfig.kv_splits): the table's choice,
the clipped tile ranges, and split forwards against unsplit ones and the
reference, in the interpreter (the H200 runs them in the gpu campaign's decode
draws)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ua_kernels
import ua_reference
from ua_kernels import KernelConfig
from ua_kernels.softmax_state import combine_splits
from ua_kernels.tile_math import TileMask, Tiles
from ua_kernels.triton import decode, tuned
from ua_reference.contract import validate_call


def _spec(b, tq, tk, hq, hkv, d=128):
  q = jax.ShapeDtypeStruct((b, tq, hq, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, tk, hkv, d), jnp.bfloat16)
  return validate_call(q, k, k).spec


@pytest.mark.parametrize("shape, splits", [
    ((1, 1, 32768, 32, 32), 9),     # 32 programs: 9 splits fill 2 per multiprocessor
    ((1, 1, 32768, 32, 8), 33),     # packed: 8 programs (one per kv head), 33 splits
    ((1, 8, 131072, 32, 8), 33),    # packed: a group's 32 rows are one tile
    ((8, 1, 32768, 32, 8), 5),      # packed: 64 programs
    ((32, 1, 32768, 32, 8), 2),     # packed: 256 programs, just under 2 per multiprocessor
    ((1, 1, 256, 32, 8), 1),        # two key tiles: too few to split
    ((1, 17, 32768, 32, 8), 1),     # not decode
    ((1, 4096, 4096, 16, 16), 1),   # prefill
])
def test_the_table_splits_decode_only_where_programs_are_few(shape, splits):
  spec = _spec(*shape)
  config = tuned.triton_config(spec, jnp.bfloat16)
  assert config.kv_splits == splits


def test_clipped_tiles_keep_their_masks_and_stay_ordered():
  tiles = Tiles((jnp.int32(0), jnp.int32(3), jnp.int32(7), jnp.int32(10)),
                (TileMask.FULL, TileMask.NONE, TileMask.POSITIONS))
  for lo, hi in ((0, 4), (4, 8), (8, 12), (12, 16)):
    clipped = tiles.clipped(jnp.int32(lo), jnp.int32(hi))
    bounds = [int(b) for b in clipped.bounds]
    assert clipped.masks == tiles.masks
    assert bounds == sorted(bounds) and lo <= bounds[0] and bounds[-1] <= max(lo, min(hi, 10))
    covered = [t for a, b in zip(bounds, bounds[1:]) for t in range(a, b)]
    assert covered == [t for t in range(10) if lo <= t < hi]


def test_combining_splits_equals_one_softmax():
  """Partials of disjoint key ranges, as finalize(with_low=True) gives them,
  combine to the softmax over all keys; a split without keys adds nothing, a
  row without any gives out 0 and shift -inf, and a sink joins the mass."""
  rng = np.random.default_rng(0)
  scale = 0.7
  logits = rng.normal(size=(3, 1, 2, 4, 5)) * 3  # [S, B, H, T, keys]
  logits[1, :, :, 0] = -np.inf                   # split 1 sees no key on row 0
  logits[:, :, :, 3] = -np.inf                   # row 3 sees none at all
  values = rng.normal(size=(3, 5, 6))            # [S, keys, D]
  m = logits.max(-1)
  with np.errstate(invalid="ignore"):  # rows of -inf only: l is 0 there
    l = np.where(np.isfinite(m), np.exp2((logits - m[..., None]) * scale).sum(-1), 0.0)
  p = np.exp2((logits - np.where(np.isfinite(m), m, 0)[..., None]) * scale)
  out = np.einsum("sbhtk,skd->sbthd", p / np.where(l > 0, l, 1)[..., None], values)
  shift = np.where(l > 0, m, -np.inf)
  low = np.where(l > 0, np.log2(np.where(l > 0, l, 1)), 0.0)
  sink = np.array([0.5, -np.inf])
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  got, got_shift, got_low = combine_splits(f32(out), f32(shift), f32(low), scale, True,
                                           f32(sink))
  all_logits = np.concatenate(list(logits), axis=-1)  # [B, H, T, 15]
  all_values = np.concatenate(list(values), axis=0)
  with_sink = np.concatenate([all_logits, np.broadcast_to(sink[None, :, None, None],
                                                          (*all_logits.shape[:-1], 1))], -1)
  mass = np.exp2(with_sink * scale)
  total = mass.sum(-1)
  want = np.einsum("bhtk,kd->bthd", mass[..., :-1] / np.where(total > 0, total, 1)[..., None],
                   all_values)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  lse2 = np.asarray(got_shift) * scale + np.asarray(got_low)
  with np.errstate(divide="ignore"):
    np.testing.assert_allclose(lse2, np.log2(total), rtol=1e-5)
  assert np.isneginf(np.asarray(got_shift)[:, 1, 3]).all()  # no key, no sink
  assert (np.asarray(got)[:, 3, 1] == 0).all()


def _inputs(b, tq, tk, hq, hkv, d, dtype, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, tq, hq, d)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(b, tk, hkv, d)), dtype) for _ in range(2))
  return q, k, v, rng


# (Tq, Tk, Hq, Hkv, D, dtype, options, splits): offsets with rows of no key,
# windows, the keys' own ids, sinks, temperature and a cap.
CASES = [
    (1, 200, 4, 2, 32, jnp.float32, {}, 4),
    (3, 256, 4, 1, 64, jnp.bfloat16, dict(causal=True), 4),
    (5, 300, 2, 2, 32, jnp.float32, dict(causal=True, window_len=70), 3),
    (2, 250, 4, 2, 32, jnp.float32, dict(sinks=True), 4),
    (4, 200, 2, 1, 32, jnp.float32, dict(segments=True, causal=True), 4),
    (1, 180, 2, 2, 32, jnp.float16, dict(temperature=True, cap_method="tanh",
                                         cap_params=(5.0,)), 6),
    (4, 200, 2, 2, 32, jnp.bfloat16, dict(q_offset=-3, causal=True, sinks=True), 4),
]


def _options(options, rng, b, tq, tk, hq):
  options = dict(options)
  if options.pop("sinks", False):
    options["sinks"] = jnp.asarray(rng.normal(size=(hq,)), jnp.float32)
  if options.pop("segments", False):
    options["segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, tq))), jnp.int32)
    options["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, tk))), jnp.int32)
  if options.pop("temperature", False):
    options["temperature"] = jnp.asarray(rng.uniform(0.5, 2, (b, tq, hq)), jnp.float32)
  return options


@pytest.mark.parametrize("pack", [False, True], ids=["split", "split-packed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"Tq{c[0]}-Tk{c[1]}-{sorted(c[6])}")
def test_the_decode_forward_is_as_close_to_the_reference_as_the_plain_one(case, pack):
  """triton.decode's forward (split keys; packed GQA heads where the case has
  a group) against the plain kernel (kv_splits=1, no packing): out within
  twice its error plus one rounding of the dtype, lse within float32
  rounding, the same rows without keys; gradients through the decode
  forward's residuals as close as through the plain one's."""
  tq, tk, hq, hkv, d, dtype, options, splits = case
  q, k, v, rng = _inputs(2, tq, tk, hq, hkv, d, dtype)
  options = _options(options, rng, 2, tq, tk, hq)
  tiles = KernelConfig(block_q=16, block_kv=16)
  spec = validate_call(q, k, v, **options).spec
  decoded = dataclasses.replace(tiles, kv_splits=splits, pack_gqa=pack)
  plain = dataclasses.replace(tiles, kv_splits=1, pack_gqa=False)
  assert decode.splits(spec, decoded.filled(tuned.triton_config(spec, dtype))) == splits
  assert not decode.applies(spec, plain.filled(tuned.triton_config(spec, dtype)))
  run = lambda config: ua_kernels.attention(q, k, v, return_lse=True, **options, config=config)
  (out_1, _), (out_s, lse_s) = run(plain), run(decoded)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  out_r, lse_r = ua_reference.attention(*f32, return_lse=True, **options)
  eps = float(jnp.finfo(dtype).eps)
  err = lambda x: np.max(np.abs(np.asarray(x, np.float32) - np.asarray(out_r)))
  assert err(out_s) <= 2 * err(out_1) + eps * float(jnp.max(jnp.abs(v)))
  np.testing.assert_array_equal(np.isfinite(lse_s), np.isfinite(lse_r))
  finite = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse_s)[finite], np.asarray(lse_r)[finite],
                             rtol=1e-5, atol=1e-5)

  def grads(fn, *qkv):
    def loss(q, k, v):
      out, lse = fn(q, k, v, return_lse=True, **options)
      weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)
      return jnp.sum(out.astype(jnp.float32) * weights) + 0.3 * jnp.sum(
          jnp.where(jnp.isfinite(lse), lse, 0.0))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*qkv)  # one compilation, not one per op

  through = lambda config: grads(
      lambda *a, **kw: ua_kernels.attention(*a, config=config, **kw), q, k, v)
  reference = grads(ua_reference.attention, *f32)
  for name, s, u, r in zip(("dq", "dk", "dv"), through(decoded), through(plain), reference):
    s, u, r = (np.asarray(x, np.float32) for x in (s, u, r))
    bound = 2 * np.max(np.abs(u - r)) + eps * np.max(np.abs(r))
    assert np.max(np.abs(s - r)) <= bound, name


def test_packing_alone_takes_the_decode_forward():
  """pack_gqa without splits runs triton.decode (one split) where there is a
  group, and the plain forward where there is none."""
  q = jax.ShapeDtypeStruct((1, 4, 8, 32), jnp.bfloat16)
  kv = lambda h: jax.ShapeDtypeStruct((1, 64, h, 32), jnp.bfloat16)
  config = KernelConfig(block_q=16, block_kv=16, kv_splits=1, pack_gqa=True)
  for heads, packs in ((2, True), (8, False)):
    spec = validate_call(q, kv(heads), kv(heads)).spec
    assert decode.applies(spec, config.filled(tuned.triton_config(spec, jnp.bfloat16))) == packs


def test_kv_splits_is_validated():
  with pytest.raises(ValueError, match="KernelConfig.kv_splits"):
    KernelConfig(kv_splits=0)
  with pytest.raises(ValueError, match="KernelConfig.kv_splits"):
    KernelConfig(kv_splits=True)


def test_splits_run_out_with_the_key_tiles():
  """Every split holds ceil(tiles / kv_splits) tiles: 12 tiles asked into 5
  splits are 4 of 3 (a fifth would be empty)."""
  q = jax.ShapeDtypeStruct((1, 1, 2, 32), jnp.float32)
  k = jax.ShapeDtypeStruct((1, 180, 2, 32), jnp.float32)
  spec = validate_call(q, k, k).spec
  config = KernelConfig(block_q=16, block_kv=16, kv_splits=5).filled(
      tuned.triton_config(spec, jnp.float32))
  assert decode.splits(spec, config) == 4


def test_the_table_packs_gqa_heads_for_decode_only():
  assert tuned.triton_config(_spec(1, 8, 32768, 32, 8), jnp.bfloat16).pack_gqa
  assert not tuned.triton_config(_spec(1, 8, 32768, 32, 32), jnp.bfloat16).pack_gqa
  assert not tuned.triton_config(_spec(1, 4096, 4096, 32, 8), jnp.bfloat16).pack_gqa
