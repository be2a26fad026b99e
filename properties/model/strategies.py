"""Hypothesis strategies that build valid Cases directly.

Shapes come from small per-profile buckets and every static option from a few
values, so compiled callables are reused across examples; tensor values come
from the drawn seed (properties/model/inputs.py). What the implementation declares
(properties/model/capabilities.py) bounds what is drawn: its dtypes and head dims,
its features, and its tiles, around whose edges sequence lengths and windows
are drawn (k*b - 1, k*b, k*b + 1), where off-by-one tile bounds live.
"""

from __future__ import annotations

import dataclasses
import math
import random

from hypothesis import strategies as st

from ua_reference.caps import CAP_METHODS

from .capabilities import Implementation
from .case import Case
from .inputs import logit_scale
from .profiles import Buckets


def _rotated(values, rotation: int) -> list:
  """``values`` starting at index ``rotation`` (mod their number): the first
  value is what Hypothesis draws in a test's first, simplest example."""
  values = list(values)
  k = rotation % len(values) if values else 0
  return values[k:] + values[:k]


def _pick(draw, values, what: str, rotation: int = 0):
  if not values:
    raise ValueError(f"the profile's buckets leave no {what} to draw")
  return draw(st.sampled_from(_rotated(values, rotation))) if len(values) > 1 else values[0]


def _first_true(rotation: int, name: str) -> bool:
  """Whether choice ``name`` puts True first under ``rotation`` (a fixed coin
  per pair; rotation 0 keeps False first, as st.booleans() does)."""
  return rotation != 0 and random.Random(f"{rotation}:{name}").random() < 0.5


def _boolean(draw, rotation: int, name: str) -> bool:
  if rotation == 0:
    return draw(st.booleans())
  return draw(st.sampled_from((True, False) if _first_true(rotation, name) else (False, True)))


def _seq_len(draw, buckets: Buckets, tiles: tuple[int, ...], rotation: int = 0,
             multi_tile: bool = False) -> int:
  """A length from the bucket, or (half the time, given tiles) one at a tile
  edge; ``multi_tile``: always at an edge past two of the smallest tiles, where
  a mask's tile-range bounds (a window's first key tile) have tiles to drop."""
  edges = sorted({k * b + d for b in tiles for k in buckets.edge_multiples for d in (-1, 0, 1)
                  if 1 <= k * b + d <= buckets.max_seq_len})
  past_two = [e for e in edges if e > 2 * min(tiles)] if tiles else []
  if multi_tile and past_two:
    return draw(st.sampled_from(_rotated(past_two, rotation)))
  if edges and draw(st.booleans()):
    return draw(st.sampled_from(_rotated(edges, rotation)))
  return draw(st.sampled_from(_rotated(buckets.seq_lens, rotation)))


def _window(draw, t: int, tiles: tuple[int, ...], rotation: int = 0) -> int:
  """Short windows, windows ending on and next to tile edges, and ones >= T."""
  values = {1, 2, max(1, t // 3), max(1, t - 1), t, t + 7}
  values |= {m * b + d for b in tiles for m in (1, 2) for d in (-1, 0, 1) if m * b + d >= 1}
  return draw(st.sampled_from(_rotated(sorted(values), rotation)))


def undrawable(buckets: Buckets, impl: Implementation, require=frozenset(),
               forbid=frozenset(), any_of=frozenset(), cap: str | None = None) -> str | None:
  """Why no case can be drawn for these demands within ``impl``'s declarations
  and the profile's buckets (None: cases can be): the plugin skips such a test
  with this reason rather than fail it on the implementation's behalf."""
  unsupported = impl.unsupported
  missing = (set(require) | ({"cap"} if cap not in (None, "none") else set())) & unsupported
  if missing:
    return f"{impl.name} {impl.lacks(missing)}"
  if cap is not None and not impl.supports_cap(cap):
    return f"{impl.name} declares cap method {cap!r} unsupported"
  if any_of and not [f for f in any_of if f not in unsupported and f not in forbid]:
    return f"{impl.name} supports none of {sorted(any_of)}"
  if not [d for d in buckets.dtypes if d in impl.dtypes]:
    return f"{impl.name} declares dtypes {impl.dtypes}, none of the profile's {buckets.dtypes}"
  if not impl.head_dim_choices(buckets.head_dims):
    return (f"{impl.name} declares none of the head dims {sorted(set(buckets.head_dims))} "
            f"nor any of properties.model.capabilities.HEAD_DIM_LADDER")
  pairs = [p for p in buckets.heads if
           ("gqa" not in require or p[0] != p[1]) and
           ("gqa" not in unsupported | set(forbid) or p[0] == p[1])]
  if not pairs:
    return "the profile's head counts leave none for the features asked"
  return None


@st.composite
def cases(draw, buckets: Buckets, impl: Implementation, require=frozenset(),
          forbid=frozenset(), any_of=frozenset(), cap: str | None = None,
          rotation: int = 0, multi_tile: bool = False) -> Case:
  """A valid Case within ``impl``'s declarations.

  ``require``/``forbid`` pin features on/off; ``any_of``: at least one of
  these features is on; ``cap`` fixes the cap method (ua-fuzz --cap).
  ``rotation`` reorders every choice (a test's chunk number): Hypothesis
  starts each test from its simplest example, the first value of every
  choice, and a time-boxed campaign of many chunks otherwise begins every
  chunk with the same configuration (docs/VERIFICATION.md, "Case mix").
  ``multi_tile``: lengths at tile edges past two tiles (_seq_len).
  """
  why = undrawable(buckets, impl, require, forbid, any_of, cap)
  if why:
    raise ValueError(why)
  unsupported = impl.unsupported
  allowed = lambda f: f not in unsupported and f not in forbid
  choosable = sorted(f for f in any_of if allowed(f))
  forced = set(require) | ({_pick(draw, choosable, 'feature', rotation)} if choosable
                           else set())

  def flag(feature):
    if feature in forced:
      return True
    return _boolean(draw, rotation, feature) if allowed(feature) else False

  dtypes = [d for d in buckets.dtypes if d in impl.dtypes]
  dims = list(impl.head_dim_choices(buckets.head_dims))
  tile_choices = buckets.tiles if impl.config is not None else (None,)
  pair = _pick(draw, tile_choices, 'tiles', rotation)
  tiles = impl.block_sizes if pair is None else tuple(sorted(set(pair)))

  t = impl.fit_seq_len(_seq_len(draw, buckets, tiles, rotation, multi_tile))
  long = t >= buckets.long_seq
  tq, tk = _lengths(draw, impl, t, flag("kv_length"), rotation)
  q_offset = _q_offset(draw, tq, tk, rotation) if flag("q_offset") else None
  head_pairs = [p for p in buckets.heads if not long or p[1] <= 2]
  if "gqa" in forced:
    head_pairs = [p for p in head_pairs if p[0] != p[1]]
  elif not allowed("gqa"):
    head_pairs = [p for p in head_pairs if p[0] == p[1]]
  hq, hkv = _pick(draw, head_pairs, 'head counts', rotation)
  batch = 1 if long else _pick(draw, buckets.batches, 'batch size', rotation)
  d = _pick(draw, dims, 'head dim', 3 * rotation)
  dtype = _pick(draw, dtypes, 'dtype', rotation)

  def choose(values):
    return draw(st.sampled_from(_rotated(values, rotation)))

  causal = flag("causal")
  window = _window(draw, t, tiles, rotation) if flag("window") else 0
  segments = "none"
  if flag("segment_ids"):
    # Wide ids first where segment ids are asked for (a focused test's one
    # example per dtype draws them), and in a third of the rest.
    segments = choose(["wide", "packed"] if "segment_ids" in require
                      else ["packed", "wide", "packed", "random", "wide", "random"])
  temperature = "none"
  if flag("temperature"):
    temperature = choose(["uniform", "extreme", "per_head", "scalar", "ones", "signed"])
  z_loss = choose([0.1, 1.0]) if flag("z_loss") else 0.0
  return_lse = flag("lse")
  distribution = choose(list(buckets.distributions))
  if distribution == "offset" and dtype == "float16" and z_loss:
    # A z-loss's gradient, w * lse per logit, at lse 3e4 passes float16's range in dk.
    distribution = "large"
  sm_scale = choose([None, None, 0.5 / math.sqrt(d), 2.0 / math.sqrt(d), -1.0 / math.sqrt(d)])
  cap_method = _cap_method(impl, cap, flag, choose)
  sinks = choose(["normal", "large", "some_minus_inf"]) if flag("sinks") else "none"
  case = Case(batch=batch, seq_len=tq, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
              dtype=dtype, causal=causal, window_len=window, segments=segments,
              temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss,
              return_lse=return_lse, distribution=distribution, tiles=pair,
              seed=draw(st.integers(0, 2 ** 31 - 1)),
              kv_seq_len=None if tk == tq else tk, q_offset=q_offset, sinks=sinks,
              sampled_rows=buckets.sampled_rows if tq >= max(buckets.sampled_from,
                                                             buckets.sampled_rows + 1) else 0)
  return _with_cap(case, cap_method, choose)


def _with_cap(case: Case, cap_method: str, choose) -> Case:
  """``case`` with its cap, the parameters around the logits' own magnitude,
  so the cap is reached, drawn apart for a two-sided cap: a large positive and
  a small negative parameter (ratios to 30) put a row's logits on either side
  of saturation."""
  scale = logit_scale(case)
  params = tuple(scale * choose([0.25, 0.5, 1.0, 2.0, 0.1, 3.0])
                 for _ in CAP_METHODS[cap_method].param_names)
  return dataclasses.replace(case, cap_method=cap_method, cap_params=params)


DECODE_LENGTHS = (1, 2, 5, 8, 16)


def _lengths(draw, impl: Implementation, t: int, other: bool, rotation: int):
  """(Tq, Tk) from the drawn length ``t``: equal, or (``other``) a decode
  step's few queries against ``t`` keys, a third as many queries (a chunk of
  a prefill), or more queries than keys (cross-attention of a long query
  against a short memory)."""
  if not other:
    return t, t
  kinds = ["decode", "fewer queries"] + (["more queries"] if t > 1 else [])
  kind = draw(st.sampled_from(_rotated(kinds, rotation)))
  if kind == "decode":
    tq = draw(st.sampled_from(_rotated([n for n in DECODE_LENGTHS if n < t] or [1], rotation)))
    return impl.fit_seq_len(tq), t
  if kind == "fewer queries":
    return impl.fit_seq_len(max(1, t // 3)), t
  return t, impl.fit_seq_len(max(1, t // 3))


def _q_offset(draw, tq: int, tk: int, rotation: int) -> int:
  """An explicit offset: the default's value given, a chunk's place in a
  prefill (0, half way), queries before every key (rows without keys under a
  causal mask) or past the last one."""
  default = tk - tq
  values = [default, 0, default // 2, -min(tq, 3), default + 5, -tq - 2]
  return draw(st.sampled_from(_rotated(values, rotation)))


def _cap_method(impl: Implementation, cap: str | None, flag, choose) -> str:
  """The case's cap method: ``cap`` where given (ua-fuzz --cap), else one
  ``impl`` supports where the cap feature is drawn on, else none."""
  methods = sorted(m for m in CAP_METHODS if m != "none" and impl.supports_cap(m))
  if cap is not None:
    return cap
  if methods and flag("cap"):
    return choose(methods)
  return "none"
