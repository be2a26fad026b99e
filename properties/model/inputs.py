"""Tensors of a Case, drawn from its seed (numpy, so identical everywhere)."""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np

from .case import Case

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _values(rng, shape, distribution):
  if distribution == "heavy_tail":
    # Student's t with 3 degrees of freedom: finite variance, tails of |x| ~ 10-30 at T = 16k.
    return rng.standard_t(3, size=shape)
  if distribution == "large":
    return rng.normal(size=shape) * rng.uniform(4.0, 12.0)
  if distribution == "ties":
    # Few distinct values: exact ties among logits and among row maxima.
    return rng.integers(-2, 3, size=shape) * 0.5
  return rng.normal(size=shape)


INT32 = np.iinfo(np.int32)


def _segments(rng, case: Case):
  """(query ids [B, Tq], key ids [B, Tk] or None). With the keys' own ids
  (Case.passes_kv_segment_ids) the documents are drawn over every position
  queries and keys take (query i at key position i + offset), so a query
  belongs to the document of its position, and both sides are cut from them."""
  b, t = case.batch, case.seq_len
  if not case.passes_kv_segment_ids:
    return _segment_rows(rng, case, b, t), None
  if case.segments == "random":
    return (rng.integers(0, 3, size=(b, t)).astype(np.int32),
            rng.integers(0, 3, size=(b, case.tk)).astype(np.int32))
  first = min(0, case.offset)
  span = max(case.tk, case.offset + t) - first
  ids = _segment_rows(rng, case, b, span)
  start = case.offset - first
  return ids[:, start:start + t], ids[:, -first:-first + case.tk]


def _segment_rows(rng, case: Case, b: int, t: int):
  if case.segments == "random":
    return rng.integers(0, 3, size=(b, t)).astype(np.int32)
  rows = []
  for _ in range(b):
    ids, doc = [], 0
    while len(ids) < t:
      # Short documents, 1-token ones included, plus the odd long one.
      length = int(rng.choice([1, 1, 2, 3, 5, 8, 13, max(1, t // 2)]))
      ids.extend([doc] * length)
      doc += 1
    rows.append(ids[:t])
  rows = np.asarray(rows, np.int64)
  if case.segments == "wide":
    rows = np.stack([_wide_ids(rng, row, i) for i, row in enumerate(rows)])
  return rows.astype(np.int32)


def _wide_ids(rng, labels, row: int):
  """Document labels 0, 1, ... of one row as ids across the int32 range: by
  row, the largest ids counting down or the most negative counting up, 256
  apart, or sparse ones a multiple of 2^16 apart (ids narrowed to 8 or 16 bits
  all collide); and every
  fourth document takes the id of the one two before it, so equal ids meet in
  documents apart (the contract compares ids, not runs)."""
  n = int(labels.max()) + 1
  kind = (row + int(rng.integers(3))) % 3
  k = np.arange(n, dtype=np.int64)
  if kind == 0:
    values = INT32.max - 256 * k
  elif kind == 1:
    values = INT32.min + 256 * k
  else:  # distinct ids spread over the whole range, equal in their low 16 bits
    step = max(1, (2 ** 32 - 1) // n // 65536) * 65536 if n < 65536 else 1
    values = INT32.min + int(rng.integers(65536)) % step + rng.permutation(n) * step
  for d in range(3, n, 4):
    values[d] = values[d - 2]
  return values[labels]


def _temperature(rng, case: Case):
  b, t, h = case.batch, case.seq_len, case.num_q_heads
  kind = case.temperature
  if kind == "none":
    return None
  if kind == "ones":
    return np.ones((b, t, h), np.float32)
  if kind == "uniform":
    return rng.uniform(0.25, 4.0, size=(b, t, h)).astype(np.float32)
  if kind == "signed":  # the contract allows negative temperatures (a reversed row)
    sign = rng.choice(np.asarray([-1.0, 1.0], np.float32), size=(b, t, h))
    return (sign * rng.uniform(0.25, 4.0, size=(b, t, h))).astype(np.float32)
  if kind == "extreme":
    return np.exp(rng.uniform(math.log(1e-3), math.log(50.0), size=(b, t, h))).astype(np.float32)
  if kind == "per_head":
    return rng.uniform(0.5, 2.0, size=(h,)).astype(np.float32)
  if kind == "scalar":
    return np.float32(rng.uniform(0.5, 2.0))
  raise ValueError(f"unknown temperature kind {kind!r}")


def _saturating(rng, case: Case):
  """q, k, v whose every row of logits lies far beyond any drawn cap, with one
  sign per row (a capped row sits at its cap's upper or at its lower bound), and
  values scaled by 2^60 or 2^-60 (float16: unscaled): the ends of the range in
  which the forward's fixed exp2 shift (ua_kernels.tile_math.fixed_shift) must
  neither overflow nor underflow."""
  b, t, tk, hq, hkv, d = (case.batch, case.seq_len, case.tk, case.num_q_heads,
                          case.num_kv_heads, case.head_dim)
  u = rng.normal(size=d)
  sign = rng.choice([-1.0, 1.0], size=(b, t, hq, 1))
  q = sign * 100.0 * u + 0.1 * rng.normal(size=(b, t, hq, d))
  k = u + 0.1 * rng.normal(size=(b, tk, hkv, d))
  v_scale = 1.0 if case.dtype == "float16" else 2.0 ** float(rng.choice([-60, 60]))
  return q, k, v_scale * rng.normal(size=(b, tk, hkv, d))


# The offset distribution: each query row's logits (after sm_scale and temperature) share
# an offset of 10^3 to 10^6 in magnitude, log-uniform; float16's query side is clipped to
# its range (so its offsets reach about 4.8e5 at |sm_scale| 1/8 and go no higher: the edge
# of float16), the key side's first column being OFFSET_ANCHOR.
OFFSET_RANGE = (1e3, 1e6)
OFFSET_ANCHOR = 64.0


def _offset(rng, case: Case, temperature):
  """q, k whose logits in each query row share a large offset (random sign,
  log-uniform in OFFSET_RANGE) over a spread of about one unit: a softmax far
  from one-hot although its logits are huge, so that its probabilities rest on
  the last bits of the exp2 argument and of the lse (docs/DEFECTS.md, L1 and
  D32). The offset rides on the first column (k's is OFFSET_ANCHOR for every
  key, q's carries the offset), the spread on the others."""
  b, t, tk, hq, hkv, d = (case.batch, case.seq_len, case.tk, case.num_q_heads,
                          case.num_kv_heads, case.head_dim)
  sm = case.sm_scale if case.sm_scale is not None else 1.0 / math.sqrt(d)
  lo, hi = OFFSET_RANGE
  offset = (rng.choice([-1.0, 1.0], size=(b, t, hq))
            * np.exp(rng.uniform(math.log(lo), math.log(hi), size=(b, t, hq))))
  temp = 1.0 if temperature is None else np.broadcast_to(temperature, (b, t, hq))
  first = offset / (temp * sm * OFFSET_ANCHOR)  # no temperature kind draws 0
  q = rng.normal(size=(b, t, hq, d))
  k = rng.normal(size=(b, tk, hkv, d))
  # float16 holds at most 65504: a small temperature times a small scale would need
  # more, and gets a smaller offset.
  q[..., 0] = np.clip(first, -6e4, 6e4) if case.dtype == "float16" else first
  k[..., 0] = OFFSET_ANCHOR
  return q, k


# Activation-like inputs (docs/SCALE.md, "Activation-like inputs"): keys with a few
# outlier channels (as KV-cache quantization papers measure them: keys, not queries, carry
# fixed channels of large magnitude) and values with their own; keys correlated across
# positions (a shared direction plus a slowly varying part, so rows of logits are nearly flat
# over long spans and their gradients cancel); heavy tails (inputs.py, _values).
ACTIVATION_LIKE = ("outliers", "heavy_tail", "correlated")
OUTLIER_SCALE = 100.0
OUTLIER_CHANNELS = (1, 2, 3)
CORRELATION = 0.99  # of a key with the one before it


def _outliers(rng, x):
  """``x`` with 1-3 of its channels (the same at every position and head) times
  OUTLIER_SCALE."""
  d = x.shape[-1]
  n = min(d, int(rng.choice(OUTLIER_CHANNELS)))
  x = np.array(x)
  x[..., rng.choice(d, size=n, replace=False)] *= OUTLIER_SCALE
  return x


def _correlated(rng, shape):
  """[B, T, H, D] keys: a direction shared by every position of a head (3x a
  unit draw) plus an AR(1) process along T of correlation CORRELATION."""
  b, t, h, d = shape
  shared = 3.0 * rng.normal(size=(b, 1, h, d))
  noise = rng.normal(size=shape)
  walk = np.empty(shape)
  walk[:, 0] = noise[:, 0]
  keep, fresh = CORRELATION, math.sqrt(1.0 - CORRELATION ** 2)
  for i in range(1, t):
    walk[:, i] = keep * walk[:, i - 1] + fresh * noise[:, i]
  return shared + walk


def _activation_like(rng, case: Case):
  """q, k, v of an ACTIVATION_LIKE distribution."""
  b, t, tk, hq, hkv, d = (case.batch, case.seq_len, case.tk, case.num_q_heads,
                          case.num_kv_heads, case.head_dim)
  q = _values(rng, (b, t, hq, d), case.distribution)
  if case.distribution == "correlated":
    k = _correlated(rng, (b, tk, hkv, d))
  else:
    k = _values(rng, (b, tk, hkv, d), case.distribution)
  v = _values(rng, (b, tk, hkv, d), case.distribution)
  if case.distribution == "outliers":
    k, v = _outliers(rng, k), _outliers(rng, v)
  return q, k, v


def sample_blocks(case: Case) -> list[tuple[int, int]] | None:
  """[start, stop) of the query blocks an oracle judges when the case samples
  rows (Case.sampled_rows; None: every row): blocks of one length,
  SAMPLE_BLOCK rows or fewer, the first and the last (the largest offsets into
  every tensor) and ones drawn from the seed between them, sorted,
  Case.sampled_rows rows in all. One length, so that every block of every
  input seed runs one compiled reference (runner._reference, its offset traced)."""
  n, t = case.sampled_rows, case.seq_len
  if not n or t <= n:
    return None
  block = max(1, min(SAMPLE_BLOCK, n // 4))
  starts = {0, t - block}
  rng = np.random.default_rng([case.seed, 0x5A3])
  candidates = np.arange(block, t - 2 * block + 1, block)
  rng.shuffle(candidates)
  for start in candidates:
    if len(starts) * block >= n:
      break
    starts.add(int(start))
  return [(s, s + block) for s in sorted(starts)]


def sampled_rows(case: Case) -> np.ndarray | None:
  """The query rows of sample_blocks, in order (None: every row)."""
  blocks = sample_blocks(case)
  return None if blocks is None else np.concatenate([np.arange(a, b) for a, b in blocks])


SAMPLE_BLOCK = 64


def make_inputs(case: Case) -> dict:
  """q, k, v (case dtype), segment_ids, temperature, dout, dlse,
  kv_segment_ids and sinks (None where the case has none) as numpy,
  read-only: the last few cases' are kept, since one oracle check asks for its
  inputs several times (the harness, the VJP, the plain call), and at T = 16k
  drawing them takes seconds (docs/VERIFICATION.md, "Where a case's seconds go")."""
  return dict(_drawn(case))


@functools.lru_cache(maxsize=2)
def _drawn(case: Case) -> dict:
  inputs = _draw(case)
  for x in inputs.values():
    if isinstance(x, np.ndarray):
      x.setflags(write=False)
  return inputs


def _draw(case: Case) -> dict:
  """The inputs, drawn in one order: a case of one length without sinks draws
  what it drew before keys of another length and sinks existed."""
  rng = np.random.default_rng(case.seed)
  dtype = DTYPES[case.dtype]
  b, t, tk, hq, hkv, d = (case.batch, case.seq_len, case.tk, case.num_q_heads,
                          case.num_kv_heads, case.head_dim)
  if case.distribution == "saturating":
    q, k, v = (x.astype(dtype) for x in _saturating(rng, case))
  elif case.distribution == "offset":
    # The offset is of the logits as scaled: the temperature is drawn first.
    temp = _temperature(rng, case)
    q, k = (x.astype(dtype) for x in _offset(rng, case, temp))
    v = rng.normal(size=(b, tk, hkv, d)).astype(dtype)
  elif case.distribution in ACTIVATION_LIKE:
    q, k, v = (x.astype(dtype) for x in _activation_like(rng, case))
  else:
    q = _values(rng, (b, t, hq, d), case.distribution).astype(dtype)
    k = _values(rng, (b, tk, hkv, d), case.distribution).astype(dtype)
    v = rng.normal(size=(b, tk, hkv, d)).astype(dtype)
  seg, kv_seg = (None, None) if case.segments == "none" else _segments(rng, case)
  if case.distribution != "offset":
    temp = _temperature(rng, case)
  dout = rng.normal(size=(b, t, hq, d)).astype(dtype)
  dlse = rng.normal(size=(b, hq, t)).astype(np.float32)
  sinks = _sinks(rng, case)
  if case.distribution == "sink_channel":
    q, k, sinks = _sink_channel(case, q, k, sinks)
  rows = sampled_rows(case)
  if rows is not None:
    # Cotangents on the judged rows alone: the others then add nothing to dk, dv
    # and d sinks (without a z-loss), and their dq is exactly 0 (runner.Harness).
    keep = np.zeros(t, bool)
    keep[rows] = True
    dout = np.where(keep[None, :, None, None], dout, 0).astype(dtype)
    dlse = np.where(keep[None, None, :], dlse, 0).astype(np.float32)
  return {"q": q, "k": k, "v": v, "segment_ids": seg, "temperature": temp,
          "dout": dout, "dlse": dlse, "kv_segment_ids": kv_seg, "sinks": sinks}


def _sink_channel(case: Case, q, k, sinks):
  """Normal inputs whose last channel can carry each head's sink as a key's
  logit (checks.sink_is_an_extra_key): the keys' last channel 0, the queries'
  sink / sm_scale (rounded to the dtype); the sinks then sm_scale times that, in
  float32, so that a key (0, ..., 0, 1) has exactly the sink as its logit."""
  sm = case.sm_scale if case.sm_scale is not None else 1.0 / math.sqrt(case.head_dim)
  limit = float(np.finfo(q.dtype).max) / 2 if q.dtype != DTYPES["bfloat16"] else 1e30
  channel = np.clip(np.where(np.isfinite(sinks), sinks, 0.0) / sm, -limit, limit).astype(q.dtype)
  q, k = q.copy(), k.copy()
  q[..., -1] = channel
  k[..., -1] = 0
  sinks = np.where(np.isfinite(sinks), np.float32(sm) * channel.astype(np.float32), sinks)
  return q, k, sinks.astype(np.float32)


def _sinks(rng, case: Case):
  """[Hq] float32 sinks, or None. "normal": about a row's lse (log Tk, give or
  take the logits' scale), so a sink takes a share of the row; "large": ten
  logit scales above it, so the sink takes most of it; "some_minus_inf": the
  normal ones, every other head's -inf (no sink there); "minus_inf": all -inf."""
  if case.sinks == "none":
    return None
  hq = case.num_q_heads
  if case.sinks == "minus_inf":
    return np.full((hq,), -np.inf, np.float32)
  scale = min(logit_scale(case), 1e3)
  spread = 10.0 if case.sinks == "large" else 0.0
  sinks = math.log(case.tk) + scale * (spread + rng.normal(size=hq))
  if case.sinks == "some_minus_inf":
    sinks[::2] = -np.inf
  return sinks.astype(np.float32)


def logit_scale(case: Case) -> float:
  """Typical |scaled logit| of the case's distribution, to place caps."""
  sm = case.sm_scale if case.sm_scale is not None else 1.0 / math.sqrt(case.head_dim)
  # saturating: caps up to 2*24 = 48 logit units, all reached (its logits are
  # in the hundreds); caps of 24 give a fixed shift whose bounds are far apart.
  if case.distribution == "offset":  # the offsets' geometric middle, before temperature
    return math.sqrt(OFFSET_RANGE[0] * OFFSET_RANGE[1])
  # outliers: a product with one key channel of 100x, about 100 / sqrt(D) of a plain
  # logit's spread at D = 64 and more; correlated: the shared direction's 3x.
  spread = {"normal": 1.0, "large": 8.0, "ties": 1.0, "saturating": 24.0,
            "sink_channel": 1.0, "heavy_tail": 1.7, "correlated": 3.0,
            "outliers": max(1.0, OUTLIER_SCALE / math.sqrt(case.head_dim))}[case.distribution]
  return abs(sm) * spread * math.sqrt(case.head_dim)
