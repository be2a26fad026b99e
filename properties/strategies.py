"""Hypothesis strategies that build valid Cases directly.

Shapes come from small per-profile buckets and every static option from a few
values, so compiled callables are reused across examples; tensor values come
from the drawn seed (properties/inputs.py). What the implementation declares
(properties/capabilities.py) bounds what is drawn: its dtypes and head dims,
its features, and its tiles, around whose edges sequence lengths and windows
are drawn (k*b - 1, k*b, k*b + 1), where off-by-one tile bounds live.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from ua_reference.caps import CAP_METHODS

from .capabilities import Implementation
from .case import Case
from .inputs import logit_scale
from .profiles import Buckets


def _pick(draw, values, what: str):
  if not values:
    raise ValueError(f"the profile's buckets leave no {what} to draw")
  return draw(st.sampled_from(values)) if len(values) > 1 else values[0]


def _seq_len(draw, buckets: Buckets, tiles: tuple[int, ...]) -> int:
  """A length from the bucket, or (half the time, given tiles) one at a tile edge."""
  edges = sorted({k * b + d for b in tiles for k in buckets.edge_multiples for d in (-1, 0, 1)
                  if 1 <= k * b + d <= buckets.max_seq_len})
  if edges and draw(st.booleans()):
    return draw(st.sampled_from(edges))
  return draw(st.sampled_from(buckets.seq_lens))


def _window(draw, t: int, tiles: tuple[int, ...]) -> int:
  """Short windows, windows ending on and next to tile edges, and ones >= T."""
  values = {1, 2, max(1, t // 3), max(1, t - 1), t, t + 7}
  values |= {m * b + d for b in tiles for m in (1, 2) for d in (-1, 0, 1) if m * b + d >= 1}
  return draw(st.sampled_from(sorted(values)))


@st.composite
def cases(draw, buckets: Buckets, impl: Implementation, require=frozenset(),
          forbid=frozenset(), any_of=frozenset(), cap: str | None = None) -> Case:
  """A valid Case within ``impl``'s declarations.

  ``require``/``forbid`` pin features on/off; ``any_of``: at least one of
  these features is on; ``cap`` fixes the cap method (ua-fuzz --cap).
  """
  unsupported = impl.unsupported
  missing = (set(require) | ({"cap"} if cap not in (None, "none") else set())) & unsupported
  if missing:
    raise ValueError(f"{impl.name} declares {sorted(missing)} unsupported")
  if cap is not None and not impl.supports_cap(cap):
    raise ValueError(f"{impl.name} declares cap method {cap!r} unsupported")
  allowed = lambda f: f not in unsupported and f not in forbid
  choosable = sorted(f for f in any_of if allowed(f))
  if any_of and not choosable:
    raise ValueError(f"{impl.name} supports none of {sorted(any_of)}")
  forced = set(require) | ({_pick(draw, choosable, 'feature')} if choosable else set())

  def flag(feature):
    if feature in forced:
      return True
    return draw(st.booleans()) if allowed(feature) else False

  dtypes = [d for d in buckets.dtypes if d in impl.dtypes]
  dims = [d for d in buckets.head_dims if impl.head_dims(d)]
  if not dtypes or not dims:
    raise ValueError(f"{impl.name} supports none of the profile's "
                     f"{'dtypes' if not dtypes else 'head dims'}")
  tile_choices = buckets.tiles if impl.config is not None else (None,)
  pair = _pick(draw, tile_choices, 'tiles')
  tiles = impl.block_sizes if pair is None else tuple(sorted(set(pair)))

  t = _seq_len(draw, buckets, tiles)
  long = t >= buckets.long_seq
  head_pairs = [p for p in buckets.heads if not long or p[1] <= 2]
  if "gqa" in forced:
    head_pairs = [p for p in head_pairs if p[0] != p[1]]
  elif not allowed("gqa"):
    head_pairs = [p for p in head_pairs if p[0] == p[1]]
  hq, hkv = _pick(draw, head_pairs, 'head counts')
  batch = 1 if long else _pick(draw, buckets.batches, 'batch size')
  d = _pick(draw, dims, 'head dim')
  dtype = _pick(draw, dtypes, 'dtype')

  causal = flag("causal")
  window = _window(draw, t, tiles) if flag("window") else 0
  segments = "none"
  if flag("segment_ids"):
    segments = "packed" if "segment_ids" in require else draw(
        st.sampled_from(["packed", "packed", "random"]))
  temperature = "none"
  if flag("temperature"):
    temperature = draw(st.sampled_from(["uniform", "extreme", "per_head", "scalar", "ones",
                                        "signed"]))
  z_loss = draw(st.sampled_from([0.1, 1.0])) if flag("z_loss") else 0.0
  return_lse = flag("lse")
  distribution = draw(st.sampled_from(["normal", "normal", "large", "ties", "saturating"]))
  sm_scale = draw(st.sampled_from([None, None, 0.5 / math.sqrt(d), 2.0 / math.sqrt(d),
                                   -1.0 / math.sqrt(d)]))

  methods = sorted(m for m in CAP_METHODS if m != "none" and impl.supports_cap(m))
  if cap is not None:
    cap_method = cap
  elif methods and flag("cap"):
    cap_method = draw(st.sampled_from(methods))
  else:
    cap_method = "none"
  case = Case(batch=batch, seq_len=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
              dtype=dtype, causal=causal, window_len=window, segments=segments,
              temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss,
              return_lse=return_lse, distribution=distribution, tiles=pair,
              seed=draw(st.integers(0, 2 ** 31 - 1)))
  # Cap parameters around the logits' own magnitude, so the cap is reached.
  scale = logit_scale(case)
  params = tuple(scale * draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
                 for _ in CAP_METHODS[cap_method].param_names)
  return dataclasses.replace(case, cap_method=cap_method, cap_params=params)
