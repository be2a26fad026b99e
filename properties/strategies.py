"""Hypothesis strategies that build valid Cases directly (no filtering).

Shapes come from small per-profile buckets and every static option from a few
values, so compiled callables are reused across examples; tensor values come
from the drawn seed (properties/inputs.py).
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import strategies as st

from ua_kernels.cap_functions import CAP_METHODS

from .case import Case
from .inputs import logit_scale

# Six block sizes (fwd q/kv, dq q/kv, dkv q/kv): equal and unequal tiles.
_SMALL_BLOCKS = ((16,) * 6, (32, 16, 16, 32, 32, 16), (16, 32, 32, 16, 16, 32))


@dataclasses.dataclass(frozen=True)
class Buckets:
  seq_lens: tuple[int, ...]
  head_dims: tuple[int, ...]
  heads: tuple[tuple[int, int], ...]     # (Hq, Hkv)
  batches: tuple[int, ...]
  blocks: tuple[tuple[int, ...] | None, ...]
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  long_seq: int = 1 << 30                # from this T on: B=1, at most 2 kv heads


BUCKETS = {
    # Primes, block multiples and +-1 around them; MHA, GQA 2/4/8 and MQA.
    "ci": Buckets(seq_lens=(1, 2, 7, 16, 17, 31, 33, 48, 64, 97),
                  head_dims=(16, 24, 32, 40, 64),
                  heads=((1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 1), (8, 4)),
                  batches=(1, 2), blocks=_SMALL_BLOCKS),
    "dev": Buckets(seq_lens=(1, 3, 16, 31, 33, 64, 65, 127, 128, 129, 211, 256),
                   head_dims=(16, 24, 32, 48, 64, 80, 128),
                   heads=((1, 1), (3, 3), (2, 1), (4, 2), (4, 1), (8, 2), (8, 1)),
                   batches=(1, 2, 3), blocks=_SMALL_BLOCKS + ((64,) * 6,)),
    "gpu": Buckets(seq_lens=(1, 17, 128, 255, 1000, 1024, 2048, 4097, 16384),
                   head_dims=(16, 64, 80, 128, 256),
                   heads=((1, 1), (4, 4), (4, 1), (8, 2), (16, 4)),
                   batches=(1, 2), blocks=(None,), long_seq=4097),
}
BUCKETS["fuzz"] = BUCKETS["dev"]


def _window(draw, t: int) -> int:
  return draw(st.sampled_from(sorted({1, 2, max(1, t // 3), max(1, t - 1), t, t + 7})))


def _allowed(feature, unsupported, require, forbid):
  """(may it be on, must it be on) for one feature."""
  can = feature not in unsupported and feature not in forbid
  return can, can and feature in require


@st.composite
def cases(draw, buckets: Buckets, unsupported=frozenset(), require=frozenset(),
          forbid=frozenset(), cap: str | None = None, dtypes=None) -> Case:
  """A valid Case honouring the implementation's ``ua_unsupported`` set.

  ``require``/``forbid`` pin features on/off for properties that need them;
  ``cap`` fixes the cap method (ua-fuzz --cap).
  """
  def flag(feature):
    can, must = _allowed(feature, unsupported, require, forbid)
    if must:
      return True
    return draw(st.booleans()) if can else False

  t = draw(st.sampled_from(buckets.seq_lens))
  long = t >= buckets.long_seq
  head_pairs = [p for p in buckets.heads if not long or p[1] <= 2]
  gqa_can, gqa_must = _allowed("gqa", unsupported, require, forbid)
  if gqa_must:
    head_pairs = [p for p in head_pairs if p[0] != p[1]]
  elif not gqa_can:
    head_pairs = [p for p in head_pairs if p[0] == p[1]]
  hq, hkv = draw(st.sampled_from(head_pairs))
  batch = 1 if long else draw(st.sampled_from(buckets.batches))
  d = draw(st.sampled_from(buckets.head_dims))
  dtype = draw(st.sampled_from(dtypes or buckets.dtypes))

  causal = flag("causal")
  window = _window(draw, t) if flag("window") else 0
  segments = "none"
  if flag("segment_ids"):
    segments = draw(st.sampled_from(["packed", "packed", "random"]))
  if "segment_ids" in require:
    segments = "packed"
  temperature = "none"
  if flag("temperature"):
    temperature = draw(st.sampled_from(["uniform", "extreme", "per_head", "scalar", "ones",
                                        "signed"]))
  z_loss = draw(st.sampled_from([0.1, 1.0])) if flag("z_loss") else 0.0
  return_lse = flag("lse")
  distribution = draw(st.sampled_from(["normal", "normal", "large", "ties", "saturating"]))
  sm_scale = draw(st.sampled_from([None, None, 0.5 / math.sqrt(d), 2.0 / math.sqrt(d),
                                   -1.0 / math.sqrt(d)]))

  cap_can, cap_must = _allowed("cap", unsupported, require, forbid)
  if cap is not None:
    cap_method = cap
  elif cap_can and (cap_must or draw(st.booleans())):
    cap_method = draw(st.sampled_from(sorted(m for m in CAP_METHODS if m != "none")))
  else:
    cap_method = "none"
  case = Case(batch=batch, seq_len=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
              dtype=dtype, causal=causal, window_len=window, segments=segments,
              temperature=temperature, sm_scale=sm_scale, z_loss_weight=z_loss,
              return_lse=return_lse, distribution=distribution,
              blocks=draw(st.sampled_from(buckets.blocks)),
              seed=draw(st.integers(0, 2 ** 31 - 1)))
  # Cap parameters around the logits' own magnitude, so the cap is reached.
  scale = logit_scale(case)
  params = tuple(scale * draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
                 for _ in CAP_METHODS[cap_method].param_names)
  return dataclasses.replace(case, cap_method=cap_method, cap_params=params)
