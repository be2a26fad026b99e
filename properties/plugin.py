"""The suite as a pytest plugin (entry point ``pytest11``; docs/PLUGINS.md).

Installing unified-attention registers it in every pytest session of that
environment. There it adds options, fixtures and the ``ua-*`` Hypothesis
profiles (when Hypothesis is installed) and imports nothing else — no jax, no
suite — until the suite's tests are collected: ``pytest --pyargs
properties.suite --impl mypkg.mod:fn``. Options:

  --impl MODULE:FUNCTION      implementation under test (default ua_kernels:attention)
  --ua-import MODULES         comma-separated modules that register cap methods
  --ua-report PATH            JSON report by feature group and property
  --ua-failures DIR           where case files go (default ua-failures)
  --ua-case-timeout SECONDS   a case running longer ends its worker, reported as a failure
                              (default: the profile's base plus the case's size share)
  --ua-minutes M              time box: no case starts after it
  --ua-database DIR|URL       Hypothesis example database (failures replay first)
  --ua-shared-database DIR|URL  combined with it: a directory read only, a Redis
                              URL (redis://HOST:PORT/DB) read and written, shared
                              by campaigns on several hosts (properties/databases.py)
  --ua-compile-cache DIR      JAX's persistent compilation cache
  --ua-compile-threads N      compile an oracle case's four executables on N threads at once
  --ua-seeds N                input seeds per drawn configuration (default: the profile's)
  --ua-save-baseline FILE     every case's error/tolerance per output, for --ua-baseline
  --ua-baseline FILE          fail when errors grew significantly against it (gates.py)

Profiles: ``--hypothesis-profile ua-ci|ua-dev|ua-fuzz|ua-gpu`` (properties/profiles.py).
The report is built from the test reports' ``user_properties`` (one entry per
case run), so it works the same under pytest-xdist.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import zlib
from typing import Any

import pytest

from .loading import DEFAULT_IMPL, import_modules

_RECORD = "ua_case"
_TEST = "test_property"  # the suite's test function (properties/suite.py)


def pytest_addoption(parser):
  group = parser.getgroup("unified-attention", "unified-attention verification suite")
  group.addoption("--impl", default=DEFAULT_IMPL,
                  help="implementation under test, as module:function")
  group.addoption("--ua-import", default="",
                  help="comma-separated modules that register cap methods")
  group.addoption("--ua-report", default=None, help="write the JSON report here")
  group.addoption("--ua-failures", default="ua-failures", help="directory of case files")
  group.addoption("--ua-case-timeout", type=float, default=None,
                  help="seconds after which a case counts as hung (ends its worker); default: "
                       "the profile's base plus the case's size share (verifier.case_timeout)")
  group.addoption("--ua-minutes", type=float, default=None,
                  help="time box: no case starts after it (tests not started are skipped)")
  group.addoption("--ua-oracle-chunks", type=int, default=None,
                  help="tests per dtype of each oracle property (default: the profile's); "
                       "more than the profile's run after every other test")
  group.addoption("--ua-database", default=None,
                  help="Hypothesis example database: a directory (default "
                       ".hypothesis/ua-examples) or a Redis URL redis://HOST:PORT/DB "
                       "(joined to the default directory)")
  group.addoption("--ua-shared-database", default=None,
                  help="example database combined with --ua-database: a directory (read "
                       "only) or a Redis URL redis://HOST:PORT/DB (read and written, "
                       "shared by campaigns on several hosts)")
  group.addoption("--ua-compile-cache", default=None,
                  help="directory of JAX's persistent compilation cache")
  group.addoption("--ua-compile-threads", type=int, default=1,
                  help="threads an oracle case's executables (the implementation's VJP and "
                       "plain call, the oracle, the reference) compile on at once")
  group.addoption("--ua-seeds", type=int, default=None,
                  help="input seeds per drawn configuration of an oracle property "
                       "(default: the profile's)")
  group.addoption("--ua-max-examples", type=int, default=None,
                  help="at most this many drawn configurations per test (default: the "
                       "profile's), for a quick run; with --ua-seeds, more cases per compile")
  group.addoption("--ua-save-baseline", default=None,
                  help="write every case's error/tolerance per output here (a baseline)")
  group.addoption("--ua-baseline", default=None,
                  help="fail when errors grew significantly against this baseline's cases")


def _check_options(config):
  """The options' values, checked before anything runs: a report path in a
  missing directory, a failures path that is a file, a negative time box, a
  module that does not import, or (given explicitly) an implementation that
  does not load is one usage error, not a crash at the end of the session or
  a failure of every test."""
  minutes = config.getoption("ua_minutes")
  if minutes is not None and not minutes >= 0:  # 0: a spent box, every test skipped
    raise pytest.UsageError(f"--ua-minutes must be at least 0, got {minutes}")
  for name in ("ua_compile_threads", "ua_seeds", "ua_max_examples"):
    value = config.getoption(name)
    if value is not None and value < 1:
      raise pytest.UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
  report = config.getoption("ua_report")
  if report and not os.path.isdir(os.path.dirname(os.path.abspath(report))):
    raise pytest.UsageError(f"--ua-report {report}: no directory "
                            f"{os.path.dirname(os.path.abspath(report))}")
  baseline = config.getoption("ua_baseline")
  if baseline:
    from .gates import load_baseline
    try:
      load_baseline(baseline)
    except (OSError, ValueError) as exc:
      raise pytest.UsageError(f"--ua-baseline {baseline}: {exc}") from exc
  failures = config.getoption("ua_failures")
  if os.path.exists(failures) and not os.path.isdir(failures):
    raise pytest.UsageError(f"--ua-failures {failures}: exists and is not a directory")
  if _runs_the_suite(config):
    database = config.getoption("ua_database")
    for option, path in (("--ua-failures", failures), ("--ua-report", report),
                         ("--ua-database", database if database and "://" not in database
                          else None)):
      unwritable = path and _unwritable(path)
      if unwritable:
        raise pytest.UsageError(
            f"{option} {path}: {unwritable} is not writable: case files, the report and "
            f"new failures could not be kept (run where you can write, or point "
            f"{option} elsewhere)")
  from .databases import DatabaseOptionError, check_option
  for option in ("ua_database", "ua_shared_database"):
    try:  # a Redis URL: parsed, and the server asked once (by the controller)
      check_option("--" + option.replace("_", "-"), config.getoption(option),
                   connect=not hasattr(config, "workerinput"))
    except DatabaseOptionError as exc:
      raise pytest.UsageError(str(exc)) from None
  names = config.getoption("ua_import")
  try:
    import_modules(names)
  except Exception as exc:  # noqa: BLE001 -- reported as the usage error it is
    raise pytest.UsageError(f"--ua-import {names}: {type(exc).__name__}: {exc}") from exc
  impl = config.getoption("impl")
  if impl != DEFAULT_IMPL and not hasattr(config, "workerinput"):
    from .capabilities import load_impl
    try:
      load_impl(impl)
    except Exception as exc:  # noqa: BLE001 -- as above
      raise pytest.UsageError(f"--impl {impl}: {type(exc).__name__}: {exc}") from exc


def _runs_the_suite(config) -> bool:
  """Whether this session collects the suite (ua-verify, pytest --pyargs
  properties.suite), not only a project's own tests beside the plugin."""
  return any("properties.suite" in str(a) or "properties/suite" in str(a) for a in config.args)


def _unwritable(path: str) -> str | None:
  """The existing directory where ``path`` would be written, if this process
  cannot write there (a read-only file system, permissions); else None."""
  here = os.path.abspath(path)
  if not os.path.isdir(here):
    here = os.path.dirname(here)
  while not os.path.exists(here):
    here = os.path.dirname(here)
  return None if os.access(here, os.W_OK) else here


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  try:  # before Hypothesis's plugin loads the --hypothesis-profile it was given
    from . import profiles
  except ImportError:  # no Hypothesis here: the suite cannot run, other tests can
    pass
  else:
    profiles.register()
  _check_options(config)
  from . import runner
  runner.compile_threads = config.getoption("ua_compile_threads")
  cache = config.getoption("ua_compile_cache")
  if cache:
    import jax
    jax.config.update("jax_compilation_cache_dir", cache)
    # Every executable, the harness's small ones too: with 0.5 s a warm H200
    # campaign compiled 1785 of its 2119 executables again (docs/VERIFICATION.md).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  workerinput = getattr(config, "workerinput", None)
  if workerinput is not None and "ua_deadline" in workerinput:
    deadline = workerinput["ua_deadline"]
  else:
    minutes = config.getoption("ua_minutes")
    deadline = None if minutes is None else time.time() + 60 * minutes
  global _SESSION
  _SESSION = config.stash[_STATE] = _State(deadline=deadline, started=time.time())
  _SESSION.config = config



@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
  """pytest-xdist: every worker keeps the controller's time box."""
  node.workerinput["ua_deadline"] = node.config.stash[_STATE].deadline


@dataclasses.dataclass
class _State:
  deadline: float | None
  started: float
  records: list = dataclasses.field(default_factory=list)
  skipped: list = dataclasses.field(default_factory=list)  # the skips' reasons
  config: Any = None
  progress_at: float = 0.0  # when the last progress line was written
  suite_ran: bool = False  # a test of the suite reported in this session
  first_round_started: int = 0  # first-round tests (chunk 0) begun in this process
  # Seconds of the first seed of each configuration this process began
  # (compiling, on the GPU tens of seconds): what a new one is expected to cost.
  first_seeds: list = dataclasses.field(default_factory=list)

  def ends_in_box(self, now: float) -> bool:
    """Whether a new configuration begun now is expected to end before the
    deadline: one begun later ends after it, while every other worker waits
    (docs/VERIFICATION.md, "The box's end")."""
    if not self.first_seeds:
      return True
    return now + statistics.median(self.first_seeds) <= self.deadline


_STATE = pytest.StashKey[_State]()
_SESSION: _State | None = None  # pytest_runtest_logreport gets no config


# --------------------------------------------------------------------------- #
# The tests: one per property, per dtype for oracle properties, in chunks.

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


def focuses() -> list[str]:
  """The focused oracle tests of each dtype: every registered cap method
  (user-registered ones included, through --ua-import), every mask kind, and
  "long". Drawn by chance, a ci run of 83 cases held two hard-cap cases and no
  length beyond 256 (docs/TOLERANCES.md, "Coverage by feature")."""
  from ua_reference.caps import CAP_METHODS
  return ([f"cap-{m}" for m in CAP_METHODS if m != "none"]
          + [f"mask-{m}" for m in MASK_FOCUSES] + ["long"])


def property_tests(profile, oracle_chunks: int | None = None) -> list["PropertyTest"]:
  """Every property's tests, in the order a time box reaches them: first one
  test of every property (the first chunk of each oracle property per dtype,
  every other property's tests), then the profile's further chunks of the
  oracle properties, then ``oracle_chunks`` minus those more. A time-boxed
  campaign asks for more than its box can run (ua-verify --minutes), so that no
  worker runs out of tests before the deadline; with the first round in front
  and the first round's shares of the box (time_share), a short box still
  starts every property. Before, the profile's ten chunks of matches_oracle per
  dtype came first, and on one H200 a two-minute box ended before six or seven
  of the eleven properties had started (docs/VERIFICATION.md). The chunked
  properties' further chunks come after the oracle's: their first round holds
  its share of the box (chunked_share), and between the oracle's chunks they
  took 31% of a 5-minute H200 box, not the 24% of that share
  (docs/VERIFICATION.md, "Comparisons on the device")."""
  from .capabilities import DTYPES
  from .registry import PROPERTIES
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
  tests spread evenly through the round (_spread)."""
  from .capabilities import DTYPES
  from .registry import PROPERTIES
  chunked = profile.chunked_properties
  by_property = []
  for prop in PROPERTIES:
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
  return _spread(by_property)


def _spread(groups: list[list]) -> list:
  """The groups' items in one list, each group's spread evenly through it (the
  k-th of n at about (k + 1/2) / n of the way), ties in the groups' order.
  pytest-xdist hands a time box's first round out in this order, two tests per
  worker and then one as workers finish, so the round's last tests start when
  the box is nearly spent: in a 2.5-minute H200 campaign (cdb10b1) the
  hidden-key property's three focused tests, last in the round, started at
  137-144 s and ran one case each (docs/VERIFICATION.md)."""
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
    from . import profiles
    tests = property_tests(profiles.active(), metafunc.config.getoption("ua_oracle_chunks"))
    metafunc.parametrize("ua_property_test", tests, ids=[t.id for t in tests])


class Suite:
  """What the suite's tests share in one session (worker): the implementation,
  the profile, the verifier and the Hypothesis settings."""

  def __init__(self, config):
    from . import profiles
    self.config = config
    self.profile = profiles.active()
    self.impl_name = config.getoption("impl")
    self.imports = import_modules(config.getoption("ua_import"), load=False)
    self._impl = None

  @property
  def impl(self):
    if self._impl is None:
      from .capabilities import load_impl
      self._impl = load_impl(self.impl_name)
    return self._impl

  def database(self, test: "PropertyTest"):
    """The example database of one test: a directory of its own under
    --ua-database (Hypothesis keys a database by the test function's source,
    which all the suite's tests share), combined with the same directory of a
    read-only --ua-shared-database, or with a Redis database (either option a
    Redis URL) that campaigns on several hosts share (properties/databases.py)."""
    from .databases import example_database
    if self.profile.hypothesis.get("database", True) is None:
      return None
    return example_database(test.id, self.impl_name, self.config.getoption("ua_database"),
                            self.config.getoption("ua_shared_database"))

  def run(self, test: PropertyTest, node) -> None:
    """Runs one property test: Hypothesis draws configurations, each runs with
    the profile's number of input seeds."""
    import hypothesis
    from hypothesis import given, settings

    from .registry import get
    from .strategies import cases, undrawable
    from .verifier import Verifier

    state = self.config.stash[_STATE]
    if state.deadline is not None and time.time() > state.deadline:
      pytest.skip("the campaign's time box (--ua-minutes) is spent")
    prop, impl = get(test.property), self.impl
    why = prop.unsupported_by(impl, test.dtype) or _focus_unsupported(test.focus, impl)
    if why:
      pytest.skip(why)
    buckets = self.profile.buckets
    if test.dtype is not None:
      buckets = dataclasses.replace(buckets, dtypes=(test.dtype,))
    if prop.name in self.profile.long_properties or test.focus == "long":
      buckets = _long(buckets, impl)
    require = prop.require | ({test.focus[len("mask-"):]} if test.focus.startswith("mask-")
                              else set())
    cap = test.focus[len("cap-"):] if test.focus.startswith("cap-") else None
    why = undrawable(buckets, impl, require, prop.forbid, prop.any_of, cap)
    if why:
      pytest.skip(why)
    # A mask's focused test draws lengths past two tiles: its tile-range
    # bounds (a window's first key tile, the causal diagonal's) have tiles to
    # drop there, and a test of one example per dtype must not leave that to
    # the edge draw's chance.
    strategy = cases(buckets, impl, require, prop.forbid, prop.any_of, cap=cap,
                     rotation=_rotation(test, self.profile),
                     multi_tile=test.focus.startswith("mask-"))
    # An offset per chunk gives a configuration drawn by two chunks different
    # inputs in each; applied before the filter, which then judges the inputs
    # the first seed runs (and draws them, at long T seconds: make_inputs
    # keeps them for the check).
    offset = 104729 * test.chunk
    strategy = strategy.map(
        lambda c: dataclasses.replace(c, seed=(c.seed + offset) % 2 ** 31)).filter(prop.applies)
    verifier = Verifier(impl, self.config.getoption("ua_failures"), self.imports,
                        record=lambda r: node.user_properties.append((_RECORD, r)),
                        case_timeout=self.config.getoption("ua_case_timeout"),
                        timeout_base=self.profile.case_timeout_base, deadline=state.deadline,
                        announce=_uncaptured_stderr(self.config),
                        worker=getattr(self.config, "workerinput", {}).get("workerid", "main"))
    chunked = prop.name in self.profile.chunked_properties
    seeds_given = self.config.getoption("ua_seeds")

    started = set()  # configurations begun: Hypothesis replays a failing one to report it
    share_ends = self._share_ends(test, state)

    failed = []  # a case of this test failed: Hypothesis is about to report it

    def body(case):
      worst = 0.0
      for i in range(input_seeds(prop, case, self.profile, seeds_given)):
        seeded = dataclasses.replace(case, seed=(case.seed + 7919 * i) % 2 ** 31)
        if seeded not in started and state.deadline is not None:
          now = time.time()
          # The time box ends every case; this test's share ends a new
          # configuration only: the further seeds of a compiled one cost
          # tenths of a second, its compile tens (docs/VERIFICATION.md).
          new = i == 0
          # A first-round test's first case always starts (every property
          # runs in a short box).
          first = new and not started and test.chunk == 0
          if now > state.deadline or (new and started and now > share_ends) or \
              (new and not first and not state.ends_in_box(now)):
            if not failed:
              # Ends the test now: Hypothesis would go on drawing examples
              # (a filter on long T draws their inputs) only to pass them.
              pytest.skip(f"the time box (--ua-minutes) ended this test after "
                          f"{len(started)} cases")
            return
        # A configuration's first seed, not a replay of one already compiled.
        measure = i == 0 and seeded not in started
        started.add(seeded)
        begun = time.time()
        try:
          errors = verifier.check(prop, seeded)
        except BaseException:
          failed.append(seeded)
          raise
        finally:
          if measure:
            state.first_seeds.append(time.time() - begun)
        worst = max([worst] + [e.ratio for e in errors if e.ratio != float("inf")])
      hypothesis.target(worst, label="error/tolerance")

    run = given(case=strategy)(body)
    examples = self.profile.examples(prop.examples, prop.oracle)
    if chunked:
      examples = self.profile.chunked_examples
    elif test.focus:
      examples = {"long": self.profile.long_examples}.get(
          test.focus, self.profile.mask_focus_examples if test.focus.startswith("mask-")
          else self.profile.focus_examples)
    cap_examples = self.config.getoption("ua_max_examples")
    if cap_examples is not None:
      examples = min(examples, cap_examples)
    database = self.database(test)
    run = settings(settings.get_profile(self.profile.hypothesis_name),
                   database=database, max_examples=examples)(run)
    seed = _seed(test, has_database=database is not None)
    if seed is not None:
      run = hypothesis.seed(seed)(run)
    run()

  def _share_ends(self, test: PropertyTest, state) -> float | None:
    """When a first-round test stops starting cases under a time box
    (time_share), taken when its cases are about to start; later tests and
    runs without a box: the deadline."""
    if state.deadline is None or test.chunk != 0:
      return state.deadline
    workerinput = getattr(self.config, "workerinput", None)
    workers = workerinput["workercount"] if workerinput else 1
    now = time.time()
    share = time_share(state.deadline - now, workers, first_round_size(self.profile),
                       state.first_round_started)
    state.first_round_started += 1
    if test.property in self.profile.chunked_properties:
      share = max(share, chunked_share(self.profile, workers, state.deadline - state.started))
    return min(state.deadline, now + share)


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
  if focus.startswith("mask-") and focus[len("mask-"):] in impl.unsupported:
    return f"{impl.name} declares {focus[len('mask-'):]!r} unsupported"
  return None


def _long(buckets, impl):
  """The buckets of tests on long sequences: the profile's long lengths
  (no tile edges) and its large head dims that ``impl`` declares (its own
  head dims if it declares none of them)."""
  dims = impl.head_dim_choices(buckets.long_head_dims) or buckets.head_dims
  return dataclasses.replace(buckets, seq_lens=buckets.long_seq_lens or buckets.seq_lens,
                             edge_multiples=() if buckets.long_seq_lens else
                             buckets.edge_multiples, head_dims=dims)


@pytest.fixture(scope="session")
def ua_suite(request):
  return Suite(request.config)


@pytest.fixture(scope="session")
def ua_impl(ua_suite):
  """The implementation under test (properties.capabilities.Implementation)."""
  return ua_suite.impl


# --------------------------------------------------------------------------- #
# The report, from the test reports.

def pytest_runtest_logreport(report):
  if _SESSION is None:
    return
  if f"::{_TEST}[" in report.nodeid:
    _SESSION.suite_ran = True
    if report.skipped and isinstance(report.longrepr, tuple):
      _SESSION.skipped.append(report.longrepr[2].removeprefix("Skipped: "))
  records = [value for name, value in report.user_properties if name == _RECORD]
  if records and report.when == "call":
    _SESSION.records.extend(records)
    _progress(_SESSION)


PROGRESS_SECONDS = 60.0


def _progress(state: "_State") -> None:
  """A line with the cases run, their failures and the time left in the box,
  at most once a minute, from the process that writes the report."""
  now = time.time()
  if state.config is None or hasattr(state.config, "workerinput") or \
      now - max(state.progress_at, state.started) < PROGRESS_SECONDS:
    return
  state.progress_at = now
  terminal = state.config.pluginmanager.get_plugin("terminalreporter")
  if terminal is None:
    return
  cases = {(r["property"], r["case"]): r["status"] for r in state.records}
  failed = sum(s != "passed" for s in cases.values())
  left = "" if state.deadline is None else \
      f", {max(0.0, state.deadline - now) / 60:.1f} min left in the box"
  terminal.write_line(f"[ua] {len(cases)} cases, {failed} failing, "
                      f"{(now - state.started) / 60:.1f} min{left}")


def _alive(pid) -> bool:
  try:
    os.kill(int(pid), 0)
  except (OSError, TypeError, ValueError):
    return False
  return True


def _uncaptured_stderr(config):
  """Writes to the terminal's standard error past pytest's capture: the
  watchdog's last words before it ends a process whose captured output is lost."""
  capman = config.pluginmanager.getplugin("capturemanager")

  def write(text: str) -> None:
    if capman is not None:
      capman.suspend_global_capture(in_=False)
    sys.stderr.write(text)
    sys.stderr.flush()

  return write


def _crashed_cases(failures_dir: str, since: float) -> list[dict]:
  """Case files that this session's dead workers left ``running`` or ``timeout``
  (written since it started, by a process no longer alive)."""
  out = []
  for path in sorted(glob.glob(os.path.join(failures_dir, "*.json"))):
    try:
      if os.path.getmtime(path) < since - 1:
        continue
      with open(path) as f:
        payload = json.load(f)
    except (OSError, ValueError):
      continue
    if not isinstance(payload, dict) or "property" not in payload or _alive(payload.get("pid")):
      continue
    if payload.get("status") in ("running", "timeout"):
      if payload["status"] == "running":
        payload["status"] = "crashed"
        with open(path, "w") as f:
          json.dump(payload, f, indent=1, sort_keys=True)
      out.append({"property": payload["property"], "status": payload["status"],
                  "replay": payload.get("replay", f"ua-repro {path}")})
  return out


# Per-row sums of a case's time: compile (tracing, lowering, compiling),
# the rest, and compilations (properties/compile_clock.py).
TIME_KEYS = ("compile_seconds", "run_seconds", "harness_seconds")
WORST_CASES = 10  # the report's worst cases, with their configurations


def _row() -> dict:
  return {"cases": 0, "failures": 0, "harness_errors": 0, "worst_ratio": 0.0, "seconds": 0.0}


def _add_time(row: dict, source: dict) -> None:
  """Adds a record's (or a row's) seconds and, where it has them (reports
  written before the split have not), its compile and run seconds,
  compilations and persistent-cache hits to ``row``."""
  row["seconds"] = round(row.get("seconds", 0.0) + source.get("seconds", 0.0), 3)
  for key in TIME_KEYS:
    if key in source:
      row[key] = round(row.get(key, 0.0) + source[key], 3)
  for key in ("compiled", "cache_hits"):
    if key in source:
      row[key] = row.get(key, 0) + source[key]


def _ratio_key(ratio) -> float:
  return float("inf") if ratio is None else ratio


def case_record(r: dict, started: float | None = None) -> dict:
  """What the report keeps of every case: enough for the distributions of
  error/tolerance per output and dtype (properties/html_report.py) and the
  time split, not the configuration; ``at``: seconds from the campaign's
  start to the case's."""
  keys = ("property", "case", "configuration", "seq_len", "oracle", "dtype", "status", "ratio",
          "ratios", "seconds", "compile_seconds", "run_seconds", "harness_seconds", "compiled",
          "cache_hits", "host", "worker")
  out = {k: r[k] for k in keys if k in r}
  if started is not None and "started_at" in r:
    out["at"] = round(r["started_at"] - started, 2)
  return out


def worst_cases(records: list[dict], n: int = WORST_CASES) -> list[dict]:
  """The ``n`` cases of largest error/tolerance, with their configuration and
  replay command (a passed case's file is removed when it passes: its
  configuration is what replays it)."""
  keys = ("property", "case", "dtype", "status", "ratio", "ratios", "replay", "config",
          "imports", "impl", "host")
  worst = sorted(records, key=lambda r: _ratio_key(r.get("ratio")), reverse=True)[:n]
  return [{k: r[k] for k in keys if k in r} for r in worst]


def build_report(records: list[dict], crashed: list[dict], seconds: float,
                 started: float | None = None) -> dict:
  """Per feature group and property: cases, failures, harness errors, worst
  error/tolerance, seconds, and of those seconds the compile and run seconds
  and compilations (persistent-cache hits where the cache was on); every
  case's record (case_record) and the worst cases (worst_cases). A case run
  twice (Hypothesis replays a failing example before it reports it) counts
  once, with its last outcome."""
  records = list({(r["property"], r["case"]): r for r in records}.values())
  groups, props = collections.defaultdict(_row), collections.defaultdict(_row)
  failures, oracle_cases, totals = [], 0, {}
  for r in records:
    oracle_cases += r["oracle"]
    _add_time(totals, r)
    for row in [groups[g] for g in r["groups"]] + [props[r["property"]]]:
      row["cases"] += 1
      row["failures"] += r["status"] == "failed"
      row["harness_errors"] += r["status"] == "harness"
      _add_time(row, r)
      row["worst_ratio"] = max(row["worst_ratio"], _ratio_key(r["ratio"]))
    if r["status"] != "passed":
      failures.append({k: r[k] for k in ("property", "status", "replay", "failed_outputs",
                                          "message", "config") if k in r})
  for c in crashed:
    props[c["property"]]["failures"] += 1
  minutes = max(seconds, 1e-9) / 60
  totals.pop("seconds", None)
  # Distinct compiled configurations (static keys) the oracle cases ran: input
  # seeds of one configuration share its executables.
  configurations = len({(r["property"], r.get("configuration", r["case"]))
                        for r in records if r["oracle"]})
  return {"cases": len(records), "oracle_cases": oracle_cases, "seconds": round(seconds, 1),
          "cases_per_minute": round(len(records) / minutes, 1),
          "oracle_cases_per_minute": round(oracle_cases / minutes, 1),
          "oracle_configurations": configurations,
          "oracle_configurations_per_minute": round(configurations / minutes, 1),
          **totals,
          "feature_groups": dict(sorted(groups.items())), "properties": dict(sorted(props.items())),
          "failures": failures, "crashed": crashed,
          "timeline": timeline(records, seconds, started),
          "worst_cases": worst_cases(records),
          "records": [case_record(r, started) for r in records]}


def skip_reasons(reasons: list[str]) -> dict[str, int]:
  """Tests skipped, counted by reason, the time box's reasons (which name how
  many cases ran) as one: a property that cannot be drawn under the
  declarations says why here, and is neither an error nor a failure."""
  counts = collections.Counter(
      "the time box (--ua-minutes) ended it" if "time box" in r else r for r in reasons)
  return dict(counts.most_common())


def timeline(records: list[dict], seconds: float, started: float | None) -> dict:
  """Where a campaign's wall seconds went besides its cases: how long its
  workers took to start their first case, when the last case started, and the
  share of workers x wall seconds the cases filled (the rest is start-up,
  collection, and workers idle while the last cases of others end)."""
  workers = len({r.get("worker", "main") for r in records}) or 1  # those that ran a case
  busy = sum(r["seconds"] for r in records)
  out = {"workers": workers, "busy_share": round(busy / max(workers * seconds, 1e-9), 3)}
  starts = [r["started_at"] for r in records if "started_at" in r]
  if started is not None and starts:
    out["first_case_started"] = round(min(starts) - started, 1)
    out["last_case_started"] = round(max(starts) - started, 1)
  return out


def _print_table(write, title, table):
  split = any("compile_seconds" in row for row in table.values())
  hits = any("cache_hits" in row for row in table.values())
  write(f"\n{title:38} {'cases':>6} {'failures':>8} {'harness':>8} {'worst err/tol':>14} "
        f"{'seconds':>8}" + (f" {'compile s':>9} {'run s':>8} {'compiled':>8}" if split else "")
        + (f" {'cache hits':>10}" if hits else "") + "\n")
  for name, row in table.items():
    ratio = row["worst_ratio"]
    ratio = "inf" if ratio == float("inf") else f"{ratio:.3f}"
    timing = ""
    if split:
      timing += (f" {row.get('compile_seconds', 0.0):9.1f} {row.get('run_seconds', 0.0):8.1f} "
                 f"{row.get('compiled', 0):8d}")
    if hits:
      timing += f" {row.get('cache_hits', 0):10d}"
    write(f"{name:38} {row['cases']:6d} {row['failures']:8d} {row['harness_errors']:8d} "
          f"{ratio:>14} {row['seconds']:8.1f}{timing}\n")


def pytest_sessionfinish(session):
  config = session.config
  if hasattr(config, "workerinput") or _STATE not in config.stash:
    return
  state = config.stash[_STATE]
  if not state.suite_ran:
    return
  crashed = _crashed_cases(config.getoption("ua_failures"), state.started)
  if not state.records and not crashed:
    return
  report = build_report(state.records, crashed, time.time() - state.started, state.started)
  report["skipped"] = skip_reasons(state.skipped)
  from . import profiles
  report.update(impl=config.getoption("impl"), profile=profiles.active().name,
                host=socket.gethostname(), commit=_commit(), command=" ".join(sys.argv),
                measured=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                versions=_package_versions())
  if _campaign_gates(config, state.records, report) and session.exitstatus == 0:
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
  report["exit_status"] = int(session.exitstatus)
  config.stash[_REPORT] = report
  path = config.getoption("ua_report")
  if path:
    with open(path, "w") as f:
      json.dump(report, f, indent=1, default=str)


_REPORT = pytest.StashKey[dict]()


def _campaign_gates(config, records: list[dict], report: dict) -> bool:
  """Adds the campaign verdicts (gates.py) to ``report``: pooled bias, and the
  comparison with --ua-baseline; writes --ua-save-baseline. True when one
  fails."""
  from . import gates
  report["bias"] = gates.pooled_bias(records)
  failed = any(v["biased"] for v in report["bias"].values())
  baseline = config.getoption("ua_baseline")
  if baseline:
    saved = gates.load_baseline(baseline)
    report["baseline"] = gates.compare_with_baseline(saved, records)
    if gates.same_platform(saved):
      failed |= any(v["regressed"] for v in report["baseline"].values())
    else:
      report["baseline_note"] = gates.platform_note(saved)
  save = config.getoption("ua_save_baseline")
  if save:
    gates.save_baseline(save, records, {"impl": report["impl"], "profile": report["profile"],
                                        "commit": report["commit"], **gates.platform()})
  return failed


def _package_versions() -> dict:
  """The versions a report was made with, read without starting a backend here
  (the controller of a GPU campaign leaves the GPUs to its workers)."""
  import importlib.metadata
  import platform
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "numpy", "hypothesis", "triton"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def _commit() -> str | None:
  """The git commit of the suite's own checkout, which a host's report came
  from, with ``+dirty`` where its files differ from that commit: None where
  this file is not tracked by git (an installed copy, even in a virtualenv
  inside a checkout) or there is no git."""
  here = os.path.dirname(os.path.abspath(__file__))
  git = lambda *args: subprocess.run(["git", "-C", here, *args], capture_output=True,
                                     text=True, timeout=10)
  try:
    if git("ls-files", "--error-unmatch", "--", os.path.basename(__file__)).returncode:
      return None
    out = git("rev-parse", "--short=12", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no", "--", here)
  except (OSError, subprocess.SubprocessError):
    return None
  if out.returncode or not out.stdout.strip():
    return None
  # A tree that differs from HEAD did not run HEAD's code: say so.
  return out.stdout.strip() + ("+dirty" if changed.returncode or changed.stdout.strip() else "")


def pytest_terminal_summary(terminalreporter, config):
  report = config.stash.get(_REPORT, None)
  if report is None:
    return
  terminalreporter.section("unified-attention verification")
  write_report(terminalreporter.write, report)


REPORT_LEGEND = (
    "worst err/tol: the largest error of any output over its tolerance (docs/TOLERANCES.md); "
    "a case passes when every element is within its tolerance, err/tol <= 1.")


def write_report(write, report: dict) -> None:
  """The report's tables, totals and failures (with their replay commands)."""
  write(REPORT_LEGEND + "\n")
  _print_table(write, "feature group", report["feature_groups"])
  _print_table(write, "property", report["properties"])
  write(f"\n{report['cases']} cases ({report['oracle_cases']} against the oracle) in "
        f"{report['seconds']} s: {report['cases_per_minute']} cases/min, "
        f"{report['oracle_cases_per_minute']} oracle cases/min"
        + (f" ({report['oracle_configurations']} compiled configurations, "
           f"{report['oracle_configurations_per_minute']}/min)"
           if "oracle_configurations" in report else "") + "\n")
  if "compile_seconds" in report:
    hits = report.get("cache_hits")
    write(f"case time: {report['compile_seconds']:.1f} s compiling ({report['compiled']} "
          f"compilations{'' if hits is None else f', {hits} from the persistent cache'}), "
          f"{report['run_seconds']:.1f} s running\n")
  for reason, count in report.get("skipped", {}).items():
    write(f"skipped: {count} test{'s' if count > 1 else ''}: {reason}\n")
  from .gates import summary_lines
  for line in summary_lines(report):
    write(line + "\n")
  for line in failure_blocks(report):
    write(line + "\n")


def _size(failure: dict) -> int:
  c = failure.get("config") or {}
  return (c.get("batch", 1) * c.get("seq_len", 1) * c.get("num_q_heads", 1)
          * c.get("head_dim", 1)) if c else 1 << 62


def describe(config: dict) -> str:
  """A case in one line: its shape and the options it turns on."""
  c = config
  parts = [f"B={c['batch']} T={c['seq_len']} H={c['num_q_heads']}/{c['num_kv_heads']} "
           f"D={c['head_dim']} {c['dtype']}"]
  parts += [name for name in ("causal",) if c.get("causal")]
  if c.get("window_len"):
    parts.append(f"window={c['window_len']}")
  if c.get("segments", "none") != "none":
    parts.append(f"segments={c['segments']}")
  if c.get("cap_method", "none") != "none":
    parts.append(f"cap={c['cap_method']}{tuple(c.get('cap_params', ()))}")
  for key in ("temperature", "distribution"):
    if c.get(key) not in (None, "none", "normal"):
      parts.append(f"{key}={c[key]}")
  if c.get("sm_scale") is not None:
    parts.append(f"sm_scale={c['sm_scale']:.4g}")
  if c.get("z_loss_weight"):
    parts.append(f"z_loss={c['z_loss_weight']}")
  if c.get("return_lse"):
    parts.append("lse")
  return " ".join(parts)


def failure_blocks(report: dict) -> list[str]:
  """One block per distinct failure (property and the outputs that failed),
  the smallest case first: what failed, on which case, the replay and the
  minimize commands; then one line for each further case of the same kind."""
  failures = report["failures"] + report["crashed"]
  if not failures:
    return []
  kinds = collections.defaultdict(list)
  for f in sorted(failures, key=_size):
    key = (f["property"], f["status"], tuple(f.get("failed_outputs") or ()))
    if f["replay"] not in {g["replay"] for g in kinds[key]}:
      kinds[key].append(f)
  lines = [f"\n{len(failures)} failing cases, {len(kinds)} distinct; the smallest of each "
           f"first (replay it with ua-repro; --minimize reduces it further):"]
  for (prop, status, outputs), group in sorted(kinds.items(), key=lambda kv: _size(kv[1][0])):
    first = group[0]
    kind = {"harness": "harness error", "failed": "FAILED"}.get(status, status.upper())
    where = f" on {first['host']}" if first.get("host") else ""
    what = f" ({', '.join(outputs)})" if outputs else ""
    lines.append(f"\n{kind} {prop}{what}{where}")
    if first.get("config"):
      lines.append(f"  case:     {describe(first['config'])}")
    if first.get("message"):
      lines.append("  why:      " + first["message"].strip().splitlines()[0][:200])
    lines.append(f"  replay:   {first['replay']}")
    lines.append(f"  minimize: {first['replay']} --minimize")
    if len(group) > 1:
      lines.append(f"  and {len(group) - 1} more such case{'s' if len(group) > 2 else ''}:")
      lines += [f"    {g['replay']}" for g in group[1:6]]
      if len(group) > 6:
        lines.append(f"    ... ({len(group) - 6} more in the JSON report)")
  return lines


# --------------------------------------------------------------------------- #
# Reports of several hosts, merged (ua-verify --merge).

def report_problems(report: dict) -> int:
  """Failures, harness errors and crashes of a report; a run that ended in
  error (pytest's exit status) counts as one when nothing else does."""
  problems = sum(row["failures"] + row["harness_errors"]
                 for row in report.get("properties", {}).values())
  problems = max(problems, len(report.get("failures", ())) + len(report.get("crashed", ())))
  return problems or int(bool(report.get("exit_status")))


def merge_reports(reports: list[tuple[str, dict]]) -> dict:
  """One report from the reports of campaigns run side by side (``(path,
  report)`` pairs; a merged report's own sources count one by one): per
  feature group and property the sums of cases, failures, harness errors,
  seconds, compile and run seconds, compilations and cache hits, and the
  largest worst error/tolerance; the totals' sums, the longest campaign's
  seconds and the sum of the rates; every failure and crash, and every case
  record, marked with its host; the worst cases of all; where each report came
  from (``merged_from``, ``hosts``, ``commits``)."""
  groups, props = collections.defaultdict(_row), collections.defaultdict(_row)
  sources, failures, crashed, records, worst = [], [], [], [], []
  totals = dict.fromkeys(("cases", "oracle_cases", "cases_per_minute",
                          "oracle_cases_per_minute"), 0)
  timing = {}
  seconds, exit_status = 0.0, 0
  for path, report in reports:
    for key in ("feature_groups", "properties", "cases"):
      if key not in report:
        raise ValueError(f"{path}: not a ua-verify report (no {key!r})")
    if "merged_from" in report:
      sources += report["merged_from"]
    else:
      sources.append({"report": path, "host": report.get("host"),
                      "commit": report.get("commit"), "impl": report.get("impl"),
                      "profile": report.get("profile"), "cases": report["cases"],
                      "seconds": report.get("seconds"), "problems": report_problems(report)})
    host = report.get("host") or ("merged" if "merged_from" in report else path)
    for merged, rows in ((groups, report["feature_groups"]), (props, report["properties"])):
      for name, row in rows.items():
        out = merged[name]
        for key in ("cases", "failures", "harness_errors"):
          out[key] += row.get(key, 0)
        _add_time(out, row)
        ratio = row.get("worst_ratio")
        out["worst_ratio"] = max(out["worst_ratio"], float("inf") if ratio is None else ratio)
    failures += [dict(f, host=f.get("host", host)) for f in report.get("failures", ())]
    crashed += [dict(c, host=c.get("host", host)) for c in report.get("crashed", ())]
    records += [dict(r, host=r.get("host", host)) for r in report.get("records", ())]
    worst += [{"impl": report.get("impl"), **w, "host": w.get("host", host)}
              for w in report.get("worst_cases", ())]
    for key in totals:
      totals[key] = round(totals[key] + report.get(key, 0), 1)
    if "compile_seconds" in report:
      _add_time(timing, report)
    seconds = max(seconds, report.get("seconds", 0.0))
    exit_status = exit_status or int(report.get("exit_status", 0) or 0)
  timing.pop("seconds", None)
  distinct = lambda key: sorted({s[key] for s in sources if s.get(key)})
  impls, profiles_ = distinct("impl"), distinct("profile")
  worst.sort(key=lambda w: _ratio_key(w.get("ratio")), reverse=True)
  return {**totals, "seconds": seconds, **timing,
          "feature_groups": dict(sorted(groups.items())), "properties": dict(sorted(props.items())),
          "failures": failures, "crashed": crashed,
          "impl": impls[0] if len(impls) == 1 else impls,
          "profile": profiles_[0] if len(profiles_) == 1 else profiles_,
          "exit_status": exit_status, "hosts": distinct("host"), "commits": distinct("commit"),
          "merged_from": sources, "worst_cases": worst[:WORST_CASES], "records": records}
