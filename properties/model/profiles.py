"""The suite's profiles: Hypothesis settings (registered as ``ua-<name>``),
shape buckets and example budgets.

Select one with ``--hypothesis-profile ua-<name>`` (or ``ua-verify --profile
<name>``); the suite reads it back with Hypothesis's public
``settings.get_current_profile_name()``. A loaded profile that is not one of
these (the user's own default, say) leaves the suite on ``ua-ci``: the
suite's tests always run under one of its own profiles, whatever else the
session runs.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, Phase, settings

@dataclasses.dataclass(frozen=True)
class Buckets:
  """The shapes and tiles one profile draws from."""

  seq_lens: tuple[int, ...]               # drawn besides the tile edges
  head_dims: tuple[int, ...]              # repeats weight the draw
  heads: tuple[tuple[int, int], ...]      # (Hq, Hkv)
  batches: tuple[int, ...]
  # (block_q, block_kv) pairs for an implementation that takes a config; None
  # stands for its own default tiles (ua_block_sizes).
  tiles: tuple[tuple[int, int] | None, ...]
  edge_multiples: tuple[int, ...] = (1, 2, 3)
  max_seq_len: int = 1 << 14
  dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16")
  long_seq: int = 1 << 30                 # from this T on: B=1, at most 2 kv heads
  # What the properties drawn on long sequences (Profile.long_properties) draw
  # from instead of seq_lens and the tile edges.
  long_seq_lens: tuple[int, ...] = ()
  # Head dims drawn with them (those the implementation declares), up to the
  # largest any implementation of the contract is asked to take.
  long_head_dims: tuple[int, ...] = (128, 192, 256)
  # Value distributions drawn (inputs.py; repeats weight the draw).
  distributions: tuple[str, ...] = ("normal", "normal", "large", "ties", "saturating", "offset")
  # Query rows the oracle judges (Case.sampled_rows) in cases of at least ``sampled_from``
  # queries; 0: every row of every case.
  sampled_rows: int = 0
  sampled_from: int = 0


_SMALL_TILES = ((16, 16), (32, 16), (16, 32))
BUCKETS = {
    # Primes, block multiples and +-1 around them; MHA, GQA 2/4/8 and MQA. The
    # default tiles (None) are drawn one time in eight, at their own edges.
    "ci": Buckets(seq_lens=(1, 2, 7, 16, 17, 31, 33, 48, 64, 97),
                  head_dims=(16, 24, 32, 40, 64, 192),
                  heads=((1, 1), (2, 2), (2, 1), (4, 2), (4, 1), (8, 1), (8, 4)),
                  batches=(1, 2), tiles=_SMALL_TILES * 2 + (None, (16, 16)),
                  max_seq_len=400, long_seq=129, long_seq_lens=(257, 300, 1025)),
    "dev": Buckets(seq_lens=(1, 3, 16, 31, 33, 64, 65, 127, 128, 129, 211, 256),
                   head_dims=(16, 24, 32, 48, 64, 80, 128, 160, 256),
                   heads=((1, 1), (3, 3), (2, 1), (4, 2), (4, 1), (8, 2), (8, 1)),
                   batches=(1, 2, 3), tiles=_SMALL_TILES + ((64, 64), None),
                   edge_multiples=(1, 2, 3, 4), max_seq_len=600, long_seq=300,
                   long_seq_lens=(257, 383, 513, 1025, 1500, 2049)),
    # The compiled kernels' own tiles, T up to 16k; GQA up to 8 with long T
    # (a short non-causal window then gives rows of every length at once).
    # Realistic values first: no shrinking here, and a campaign test's first
    # chunk starts from the first value of every choice (later chunks from
    # rotated choices: strategies.cases).
    # Lengths of 4097 and more make about one case in eight: they cost seconds
    # each, against tenths for the rest.
    "gpu": Buckets(seq_lens=(1000, 1, 17, 128, 255, 513, 1024, 2047, 2048, 4097, 8191, 16384),
                   head_dims=(128, 16, 64, 64, 80, 128, 192, 256),
                   heads=((8, 2), (1, 1), (4, 4), (4, 1), (8, 1), (16, 4), (16, 2)),
                   batches=(1, 2), tiles=(None,), edge_multiples=(1, 2, 3, 8), long_seq=4097,
                   long_seq_lens=(4097, 2047, 8191, 16384, 1000, 3000)),
}
# One TPU chip (a v5e holds 15.7 GiB): the widths TPU kernels take (multiples of
# 128, and 64), 128-row tiles' edges, lengths to 32k; the oracle runs on the
# host's CPU (runner.harness_device), one process holds the chip.
BUCKETS["tpu"] = Buckets(seq_lens=(1024, 128, 255, 513, 2048, 4096, 8192, 1, 17),
                         head_dims=(128, 256, 128, 64, 192),
                         heads=((8, 2), (1, 1), (4, 4), (4, 1), (8, 1), (16, 4)),
                         batches=(1, 2), tiles=(None,), edge_multiples=(1, 2, 3, 8),
                         max_seq_len=1 << 15, long_seq=4097,
                         long_seq_lens=(4097, 8192, 16384, 32768, 2047))
# Activation-like inputs beside the drawn ones, where cases are compiled or many.
_ACTIVATION_LIKE = ("normal", "normal", "large", "ties", "saturating", "offset", "outliers",
                    "heavy_tail", "correlated")
for _name in ("dev", "gpu", "tpu"):
  BUCKETS[_name] = dataclasses.replace(BUCKETS[_name], distributions=_ACTIVATION_LIKE)
# The TPU's oracle runs on the host's CPU, where a dense one of T >= 1k took most of a box
# (docs/VERIFICATION.md, "On a TPU"): from 4096 queries on, 256 sampled rows; lengths to 64k.
BUCKETS["tpu"] = dataclasses.replace(
    BUCKETS["tpu"], sampled_rows=256, sampled_from=4096, max_seq_len=1 << 16,
    long_seq_lens=(4097, 8192, 16384, 32768, 65536, 2047))
BUCKETS["fuzz"] = BUCKETS["dev"]
# Production lengths on one H200 (docs/SCALE.md, "Running it"): 32k to 256k
# tokens, the tile edges at 256 to 1024 tiles; the oracle judges 256 sampled rows of each
# case (Case.sampled_rows); from 64k on one batch row and at most 2 kv heads. The long
# test of each dtype starts at B*T*Hq*D = 262400 * 32 * 256 > 2^31 elements.
BUCKETS["scale"] = Buckets(seq_lens=(32768, 65536, 131072, 40961, 98304, 262144),
                           head_dims=(128, 64, 256, 128, 192),
                           heads=((32, 2), (32, 4), (8, 1), (16, 2), (8, 8), (4, 4)),
                           batches=(1, 2), tiles=(None,), edge_multiples=(256, 512, 1024),
                           max_seq_len=1 << 18, long_seq=1 << 16,
                           long_seq_lens=(262400, 131200, 65537, 200000),
                           long_head_dims=(256, 128), distributions=_ACTIVATION_LIKE,
                           sampled_rows=256, sampled_from=4097)



PREFIX = "ua-"
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


@dataclasses.dataclass(frozen=True)
class Profile:
  """``example_factor`` scales each property's ci budget; an oracle property
  runs as ``oracle_chunks`` tests per dtype (each its own Hypothesis seed, so
  that workers share them out), of ``oracle_examples`` examples each when
  given, and runs each drawn configuration with ``seeds`` input seeds
  (compiled once)."""

  name: str
  buckets: Buckets
  example_factor: float
  hypothesis: dict
  oracle_chunks: int = 1
  oracle_examples: int | None = None
  seeds: int = 1
  # Examples of each focused oracle test (campaign.schedule.focuses(): per cap method and
  # dtype; per mask kind and dtype, which matches_oracle also draws half the
  # time each), and of the long one per dtype.
  focus_examples: int = 2
  mask_focus_examples: int = 1
  long_examples: int = 1
  # Properties drawn on the long lengths and large head dims (Buckets.long_*).
  long_properties: tuple[str, ...] = ("mask_is_exact",)
  # Properties that run, like the oracle's, as ``oracle_chunks`` tests (of
  # their own example budget each), so that a campaign gives them a share of
  # its cases, not one test's: their first chunk and focused tests in the first
  # round (for chunked_box_share of the box), their further chunks after the
  # oracle's (campaign.schedule.property_tests).
  chunked_properties: tuple[str, ...] = ()
  chunked_examples: int = 1  # examples of each of their tests
  # Input seeds per configuration of a chunked property, where the seed
  # changes what it checks (Property.seed_matters): a configuration compiles
  # in tens of seconds and runs a seed in tenths, so further seeds buy cases.
  chunked_seeds: int = 1
  # Focused first-round tests of each chunked property (mask kinds, as
  # "mask-causal"), so that a time box gives them a share from its start.
  chunked_focuses: tuple[str, ...] = ()
  # The least share of a time box's worker-seconds that each chunked property's
  # first-round tests take between them: without it, how long they may go on
  # is each test's turn in the round (campaign.schedule.time_share), and a short box gave
  # the hidden-key property 6.0% of its cases (docs/VERIFICATION.md).
  chunked_box_share: float = 0.0
  # Whether focused oracle tests draw from rotated choices (strategies.cases),
  # each from its own first configuration; the ci profile's focused tests
  # keep the realistic first values.
  rotate_focused: bool = False
  # Seconds a case may run before it counts as hung, before its size's share
  # (verifier.case_timeout): compiled campaigns compile longer kernels.
  case_timeout_base: float = 600.0

  @property
  def hypothesis_name(self) -> str:
    return PREFIX + self.name

  def examples(self, budget: int, oracle: bool) -> int:
    """Examples per test for a property of ``budget`` examples in ci."""
    if oracle and self.oracle_examples is not None:
      return self.oracle_examples
    return max(1, round(budget * self.example_factor))


_COMMON = dict(deadline=None, suppress_health_check=_SLOW_OK, print_blob=True)
PROFILES = {p.name: p for p in (
    # Derandomized and bounded: the same cases on every CI run.
    Profile("ci", BUCKETS["ci"], 1.0, dict(derandomize=True, database=None,
                                             phases=[Phase.explicit, Phase.generate])),
    Profile("dev", BUCKETS["dev"], 3.0, dict(phases=[Phase.explicit, Phase.reuse,
                                                     Phase.generate, Phase.shrink]),
            focus_examples=4, mask_focus_examples=2, long_examples=2),
    # Randomized and long; targets the error/tolerance ratio.
    Profile("fuzz", BUCKETS["fuzz"], 25.0, dict(
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]),
        focus_examples=20, mask_focus_examples=10, long_examples=5),
    # The GPU campaign: compiled kernels at their own tiles; the oracle property
    # as 10 tests per dtype of 6 configurations x 24 input seeds (4320 oracle
    # cases; a configuration compiles for about 20 s and runs a seed in about
    # 1, docs/VERIFICATION.md) and 7 focused tests per dtype of 2 x 24; the exact mask and
    # the hidden-key properties as 10 tests and 3 focused ones (one per mask
    # kind, in the first round) of 15 configurations each, on lengths up to
    # 16384, with 24 input seeds where the seed changes what they check; no
    # shrinking (a failure's case file replays it); saved failures replayed first.
    Profile("gpu", BUCKETS["gpu"], 1.0, dict(
        derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate]),
        oracle_chunks=10, oracle_examples=6, seeds=24, mask_focus_examples=2,
        long_properties=("mask_is_exact", "hidden_keys_do_not_leak"),
        chunked_properties=("mask_is_exact", "hidden_keys_do_not_leak"), chunked_examples=15,
        chunked_seeds=24, chunked_focuses=("mask-causal", "mask-window", "mask-segment_ids"),
        chunked_box_share=0.12, rotate_focused=True, case_timeout_base=900.0),
    # A TPU host: the gpu profile's campaign on the TPU's shapes, in one
    # process (ua-verify --profile tpu runs no xdist workers).
    Profile("tpu", BUCKETS["tpu"], 1.0, dict(
        derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate]),
        oracle_chunks=10, oracle_examples=6, seeds=8, mask_focus_examples=2,
        long_properties=("mask_is_exact", "hidden_keys_do_not_leak"), rotate_focused=True,
        case_timeout_base=900.0),
    # Production scale on one H200: the gpu profile's order at 32k-256k tokens, a few
    # configurations of two input seeds per test (a case takes seconds to a minute).
    Profile("scale", BUCKETS["scale"], 0.5, dict(
        derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate]),
        oracle_chunks=4, oracle_examples=2, seeds=2, focus_examples=1, mask_focus_examples=1,
        long_properties=("mask_is_exact",), rotate_focused=True, case_timeout_base=1800.0),
)}


def register() -> None:
  """Registers the profiles with Hypothesis (idempotent)."""
  for profile in PROFILES.values():
    settings.register_profile(profile.hypothesis_name, **_COMMON, **profile.hypothesis)


def active(current_name: str | None = None) -> Profile:
  """The suite profile of Hypothesis's current profile (ua-ci if not one of ours)."""
  name = settings.get_current_profile_name() if current_name is None else current_name
  if name and name.startswith(PREFIX) and name[len(PREFIX):] in PROFILES:
    return PROFILES[name[len(PREFIX):]]
  return PROFILES["ci"]
