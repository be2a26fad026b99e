"""properties.model.inputs: the drawn tensors are what each distribution says."""

import dataclasses

import numpy as np
import pytest

from properties.model.case import Case
from properties.model.inputs import OFFSET_RANGE, make_inputs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("temperature", ["none", "extreme", "per_head"])
def test_offset_logits_are_huge_rows_over_a_spread_of_about_one(dtype, temperature):
  """Every query row's logits (sm_scale and temperature applied) sit within
  OFFSET_RANGE of zero, a fifth of rows past 1e4 (past 1e5 but in float16), over a spread that leaves the
  softmax far from one-hot; finite in every dtype."""
  case = Case(batch=2, seq_len=64, num_q_heads=4, num_kv_heads=2, head_dim=32, dtype=dtype,
              temperature=temperature, sm_scale=-0.125, distribution="offset", seed=5)
  x = make_inputs(case)
  q, k = (np.asarray(x[n], np.float64) for n in ("q", "k"))
  assert np.isfinite(q).all() and np.isfinite(k).all()
  temp = 1.0 if x["temperature"] is None else np.broadcast_to(
      np.asarray(x["temperature"], np.float64), (2, 64, 4))
  k = np.repeat(k, 2, axis=2)  # GQA: query heads 2h and 2h+1 share kv head h
  logits = np.einsum("bqhd,bkhd->bhqk", q, k) * case.sm_scale
  logits *= np.moveaxis(np.asarray(temp, np.float64) * np.ones((2, 64, 4)), 2, 1)[..., None]
  middle = np.median(logits, axis=-1)
  lo, hi = OFFSET_RANGE
  assert (np.abs(middle) < 1.1 * hi).all()
  if not (dtype == "float16" and temperature == "extreme"):  # float16: clipped to its range
    assert (np.abs(middle) > 0.9 * lo).all()
  assert np.mean(np.abs(middle) > 1e4) > 0.2
  if dtype != "float16":  # float16's query side is clipped to its range
    assert np.mean(np.abs(middle) > 1e5) > 0.2
  spread = logits.max(-1) - logits.min(-1)
  # temperature scales the spread too (extreme: up to 50x)
  scale = np.moveaxis(np.asarray(temp) * np.ones((2, 64, 4)), 2, 1)
  assert (spread < 40 * np.maximum(np.abs(scale), 1.0)).all()
  assert np.median(spread) > 0.5 * np.median(np.abs(scale))


def test_other_distributions_draw_as_before():
  """The offset distribution draws its temperature first; the others keep
  their order of draws (the ci profile's derandomized cases and baseline)."""
  case = Case(batch=1, seq_len=8, num_q_heads=2, num_kv_heads=2, head_dim=16,
              dtype="float32", temperature="uniform", seed=1)
  x = make_inputs(case)
  rng = np.random.default_rng(1)
  q = rng.normal(size=(1, 8, 2, 16)).astype(np.float32)
  np.testing.assert_array_equal(x["q"], q)
  offset = make_inputs(dataclasses.replace(case, distribution="offset"))
  assert not np.array_equal(offset["q"], x["q"])
