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

from .strategies import BUCKETS, Buckets

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
                                                     Phase.generate, Phase.shrink])),
    # Randomized and long; targets the error/tolerance ratio.
    Profile("fuzz", BUCKETS["fuzz"], 25.0, dict(
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])),
    # The GPU campaign: compiled kernels at their own tiles; the oracle property
    # as 10 tests per dtype of 6 configurations x 6 input seeds (1080 oracle
    # cases); no shrinking (a failure's case file replays it); saved failures
    # replayed first.
    Profile("gpu", BUCKETS["gpu"], 1.0, dict(
        derandomize=True, phases=[Phase.explicit, Phase.reuse, Phase.generate]),
        oracle_chunks=10, oracle_examples=6, seeds=6),
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
