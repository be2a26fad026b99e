"""What the suite's tests share in one pytest session (worker): the
implementation, the profile, the verifier and the Hypothesis settings, and the
fixtures that hand them to the suite's test (properties/suite.py)."""

from __future__ import annotations

import dataclasses
import sys
import time

import pytest

from ..run.loading import import_modules
from .hooks import _RECORD, _STATE
from .schedule import (PropertyTest, _focus_unsupported, _long, _rotation, _seed, chunked_share,
                       first_round_size, focus_feature, input_seeds, time_share)


class Suite:
  """What the suite's tests share in one session (worker): the implementation,
  the profile, the verifier and the Hypothesis settings."""

  def __init__(self, config):
    from ..model import profiles
    self.config = config
    self.profile = profiles.active()
    self.impl_name = config.getoption("impl")
    self.imports = import_modules(config.getoption("ua_import"), load=False)
    self._impl = None

  @property
  def impl(self):
    if self._impl is None:
      from ..model.capabilities import load_impl
      self._impl = load_impl(self.impl_name)
    return self._impl

  def database(self, test: "PropertyTest"):
    """The example database of one test: a directory of its own under
    --ua-database (Hypothesis keys a database by the test function's source,
    which all the suite's tests share), combined with the same directory of a
    read-only --ua-shared-database, or with a Redis database (either option a
    Redis URL) that campaigns on several hosts share (properties/campaign/databases.py)."""
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

    state = self.config.stash[_STATE]
    if state.deadline is not None and time.time() > state.deadline:
      pytest.skip("the campaign's time box (--ua-minutes) is spent")
    prop, strategy = self._strategy(test)
    verifier = self._verifier(node, state)
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
    examples = self._examples(test, prop)
    database = self.database(test)
    run = settings(settings.get_profile(self.profile.hypothesis_name),
                   database=database, max_examples=examples)(run)
    seed = _seed(test, has_database=database is not None)
    if seed is not None:
      run = hypothesis.seed(seed)(run)
    run()

  def _strategy(self, test: PropertyTest):
    """The property of ``test`` and the strategy of its cases: the profile's
    buckets narrowed to the test's dtype and focus; skips the test where the
    implementation's declarations leave no case to draw."""
    from ..checks.registry import get
    from ..model.strategies import cases, undrawable

    prop, impl = get(test.property), self.impl
    why = prop.unsupported_by(impl, test.dtype) or _focus_unsupported(test.focus, impl)
    if why:
      pytest.skip(why)
    buckets = self.profile.buckets
    if test.dtype is not None:
      buckets = dataclasses.replace(buckets, dtypes=(test.dtype,))
    if prop.name in self.profile.long_properties or test.focus == "long":
      buckets = _long(buckets, impl)
    feature = focus_feature(test.focus)
    require = prop.require | ({feature} if feature else set())
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
        lambda c: dataclasses.replace(c, seed=(c.seed + offset) % 2 ** 31)).filter(prop.draws)
    return prop, strategy

  def _verifier(self, node, state):
    """The verifier of one test's cases, recording each case on ``node``."""
    from ..run.verifier import Verifier

    return Verifier(self.impl, self.config.getoption("ua_failures"), self.imports,
                    record=lambda r: node.user_properties.append((_RECORD, r)),
                    case_timeout=self.config.getoption("ua_case_timeout"),
                    timeout_base=self.profile.case_timeout_base, deadline=state.deadline,
                    announce=_uncaptured_stderr(self.config),
                    worker=getattr(self.config, "workerinput", {}).get("workerid", "main"))

  def _examples(self, test: PropertyTest, prop) -> int:
    """Configurations Hypothesis draws for ``test``: the profile's for the
    property, a chunked or focused test's own, at most --ua-max-examples."""
    chunked = prop.name in self.profile.chunked_properties
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
    return examples

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


@pytest.fixture(scope="session")
def ua_suite(request):
  return Suite(request.config)


@pytest.fixture(scope="session")
def ua_impl(ua_suite):
  """The implementation under test (properties.model.capabilities.Implementation)."""
  return ua_suite.impl


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
