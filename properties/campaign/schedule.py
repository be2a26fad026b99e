"""The suite's tests and the order a time box reaches them: one test per
property, per dtype and chunk for the oracle properties, with focused tests
(docs/VERIFICATION.md, "The box's end")."""

from __future__ import annotations

import dataclasses
import zlib


@dataclasses.dataclass(frozen=True)
class PropertyTest:
  """One test of a property: per dtype, chunk, and ``focus`` (an oracle
  property's share of cases guaranteed to one cap method, mask kind, or to the
  long lengths and large head dims: focuses())."""

  property: str
  dtype: str | None = None
  chunk: int = 0
  chunks: int = 1
  focus: str = ""

  @property
  def id(self) -> str:
    parts = [self.property] + ([self.dtype] if self.dtype else [])
    parts += [self.focus] if self.focus else []
    return "-".join(parts + ([f"c{self.chunk:02d}"] if self.chunks > 1 else []))


MASK_FOCUSES = ("causal", "window", "segment_ids")
# Features of their own focused test: drawn on their own, half the time, they
# would be left to chance in a test of two examples.
FEATURE_FOCUSES = ("kv_length", "sinks")


def focus_feature(focus: str) -> str | None:
  """The feature a focused test requires (None: a cap method's or the long one)."""
  for prefix in ("mask-", "feature-"):
    if focus.startswith(prefix):
      return focus[len(prefix):]
  return None


def focuses() -> list[str]:
  """The focused oracle tests of each dtype: every registered cap method
  (user-registered ones included, through --ua-import), every mask kind, and
  "long". Drawn by chance, a ci run of 83 cases held two hard-cap cases and no
  length beyond 256 (docs/TOLERANCES.md, "Coverage by feature")."""
  from ua_reference.caps import CAP_METHODS
  return ([f"cap-{m}" for m in CAP_METHODS if m != "none"]
          + [f"mask-{m}" for m in MASK_FOCUSES] + [f"feature-{f}" for f in FEATURE_FOCUSES]
          + ["long"])


def property_tests(profile, oracle_chunks: int | None = None) -> list["PropertyTest"]:
  """Every property's tests, in the order a time box reaches them: first one
  test of every property (the first chunk of each oracle property per dtype,
  every other property's tests), then the profile's further chunks of the
  oracle properties, then ``oracle_chunks`` minus those more. A time-boxed
  campaign asks for more than its box can run (ua-verify --minutes), so that no
  worker runs out of tests before the deadline; with the first round in front
  and the first round's shares of the box (time_share), a short box still
  starts every property. Before, the profile's ten chunks of matches_oracle per
  dtype came first, and on one H200 a short box ended before most properties
  had started (docs/VERIFICATION.md). The chunked
  properties' further chunks come after the oracle's: their first round holds
  its share of the box (chunked_share), and between the oracle's chunks they
  took more of an H200 box than that share (docs/VERIFICATION.md, "Comparisons
  on the device")."""
  from ..model.capabilities import DTYPES
  from ..checks.registry import PROPERTIES
  chunks = max(profile.oracle_chunks, oracle_chunks or 0)
  later, chunked, extra = [], [], []
  for chunk in range(1, chunks):
    tests = later if chunk < profile.oracle_chunks else extra
    for prop in PROPERTIES:
      if prop.oracle and prop.per_dtype:
        tests += [PropertyTest(prop.name, dtype, chunk, chunks) for dtype in DTYPES]
      elif prop.name in profile.chunked_properties and chunk < profile.oracle_chunks:
        chunked.append(PropertyTest(prop.name, None, chunk, profile.oracle_chunks))
  return _first_round(chunks, profile) + later + chunked + extra


def _first_round(chunks: int, profile) -> list["PropertyTest"]:
  """property_tests' first round (its tests of chunk 0, oracle chunks out of
  ``chunks``, the profile's chunked properties' out of its ``oracle_chunks``):
  one test of every property, per dtype where it runs per dtype, the focused
  oracle tests and the chunked properties' focused ones, each property's
  tests spread evenly through the round (_spread). Properties for deterministic
  and for non-deterministic implementations (Property.for_deterministic) share
  one place: any implementation skips all but one of them at once."""
  from ..model.capabilities import DTYPES
  from ..checks.registry import PROPERTIES
  chunked = profile.chunked_properties
  by_property, alternatives = [], []
  for prop in PROPERTIES:
    if prop.for_deterministic is not None:
      if not alternatives:
        by_property.append([alternatives])
      alternatives.append(PropertyTest(prop.name))
      continue
    if prop.name in chunked:
      tests = [PropertyTest(prop.name, None, 0, profile.oracle_chunks)]
      tests += [PropertyTest(prop.name, focus=focus) for focus in profile.chunked_focuses]
    elif not prop.per_dtype:
      tests = [PropertyTest(prop.name)]
    elif not prop.oracle:
      tests = [PropertyTest(prop.name, dtype) for dtype in DTYPES]
    else:
      tests = [PropertyTest(prop.name, dtype, 0, chunks) for dtype in DTYPES]
      # The long lengths first: their cases are the slowest to start.
      tests += [PropertyTest(prop.name, dtype, focus=focus)
                for focus in sorted(focuses(), key=lambda f: f != "long") for dtype in DTYPES]
    by_property.append(tests)
  return [t for place in _spread(by_property)
          for t in (place if isinstance(place, list) else [place])]


def _spread(groups: list[list]) -> list:
  """The groups' items in one list, each group's spread evenly through it (the
  k-th of n at about (k + 1/2) / n of the way), ties in the groups' order.
  pytest-xdist hands a time box's first round out in this order, two tests per
  worker and then one as workers finish, so the round's last tests start when
  the box is nearly spent: a short campaign gave the tests last in the round
  one case each (docs/VERIFICATION.md)."""
  keyed = [((k + 0.5) / len(group), g, k, item)
           for g, group in enumerate(groups) for k, item in enumerate(group)]
  return [item for *_, item in sorted(keyed, key=lambda x: x[:3])]


def first_round_size(profile) -> int:
  """How many tests make ``profile``'s first round of property_tests."""
  return len(_first_round(1, profile))


def time_share(seconds_left: float, workers: int, first_round: int, started_here: int) -> float:
  """Seconds a first-round test may go on starting new cases under a time box
  (its first case always starts): what is left of the box, over the rounds of
  first-round tests this worker still has to start, were the first round spread
  evenly (``started_here`` of them begun in this worker, as many in each of the
  ``workers``). An oracle chunk alone can fill a two-minute box on a GPU, so
  without it a worker holding two first-round tests never starts the second.
  Exact without xdist (one worker: the time left over the tests left); the last
  first-round test of a worker gets all that is left, and later tests run to
  the deadline."""
  remaining = max(first_round - max(workers, 1) * started_here, 1)
  rounds = -(-remaining // max(workers, 1))
  return max(seconds_left, 0.0) / rounds


def chunked_share(profile, workers: int, box_seconds: float) -> float:
  """Seconds each first-round test of a chunked property may go on starting
  cases at least: the profile's ``chunked_box_share`` of the box's
  worker-seconds, over the property's first-round tests (its first chunk and
  its focused tests). The gpu profile's 12% of the time gives the exact mask
  and the hidden-key properties each at least 10% of a campaign's cases
  (docs/VERIFICATION.md, "Budgets by power")."""
  tests = 1 + len(profile.chunked_focuses)
  return profile.chunked_box_share * max(workers, 1) * max(box_seconds, 0.0) / tests


def pytest_generate_tests(metafunc):
  if "ua_property_test" in metafunc.fixturenames:
    from ..model import profiles
    tests = property_tests(profiles.active(), metafunc.config.getoption("ua_oracle_chunks"))
    metafunc.parametrize("ua_property_test", tests, ids=[t.id for t in tests])


def input_seeds(prop, case, profile, given: int | None = None) -> int:
  """Input seeds a drawn configuration runs with: an oracle property's
  (--ua-seeds, else the profile's), a chunked property's, one where the seed
  changes nothing the property checks (Property.seed_matters)."""
  if not prop.seed_matters(case):
    return 1
  if prop.oracle:
    return given or profile.seeds
  return profile.chunked_seeds if prop.name in profile.chunked_properties else 1


def _seed(test: PropertyTest, has_database: bool) -> int | None:
  """The Hypothesis seed of a test: its chunk number; without an example
  database, a checksum of its id; else none (Hypothesis's @seed turns the
  database off, and saved failures must replay). Without a seed, derandomize
  seeds from a digest of the test function's source, the inner function of
  Suite.run: an edit of it redrew every case of the ci profile and orphaned
  the committed precision baseline's."""
  if test.chunks > 1:
    return test.chunk
  return None if has_database else zlib.crc32(test.id.encode())


def _rotation(test: PropertyTest, profile) -> int:
  """How a test reorders its choices (strategies.cases): chunk k by k, so that
  the chunks' first, simplest examples are different configurations; under a
  profile with ``rotate_focused``, the focused tests by what follows the
  chunks (a short campaign runs mostly first examples, and every focused test
  began with the same length and head dim); the long test's first length is
  already its first long one."""
  if test.focus and test.focus != "long" and profile.rotate_focused:
    return profile.oracle_chunks + focuses().index(test.focus)
  return test.chunk


def _focus_unsupported(focus: str, impl) -> str | None:
  """Why ``impl`` cannot run a focused test (None: it can)."""
  if focus.startswith("cap-"):
    method = focus[len("cap-"):]
    if "cap" in impl.unsupported or not impl.supports_cap(method):
      return f"{impl.name} declares cap method {method!r} unsupported"
  feature = focus_feature(focus)
  if feature in impl.unsupported:
    return f"{impl.name} {impl.lacks({feature})}"
  return None


def _long(buckets, impl):
  """The buckets of tests on long sequences: the profile's long lengths
  (no tile edges) and its large head dims that ``impl`` declares (its own
  head dims if it declares none of them)."""
  dims = impl.head_dim_choices(buckets.long_head_dims) or buckets.head_dims
  return dataclasses.replace(buckets, seq_lens=buckets.long_seq_lens or buckets.seq_lens,
                             edge_multiples=() if buckets.long_seq_lens else
                             buckets.edge_multiples, head_dims=dims)
