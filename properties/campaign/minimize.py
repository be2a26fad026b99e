"""ua-repro CASE --minimize: reduces a failing case over its Case fields.

Why a reducer of our own rather than Hypothesis's shrinker: a case file is a
Case (a config and a seed), not an entry of Hypothesis's example database, and
the gpu profile, where the largest failures come from, runs without a shrink
phase; shrinking there would also spend device time on choices (the seed, the
bucket index) that say nothing about the defect. Reducing the Case's own fields
(T, batch, heads, head dim, one feature at a time) gives a case a person can
read, and every step runs the same path as the suite: ``Verifier.check``, the
property from the registry, the oracle from the runner.

A candidate is accepted only if it fails *the same way*: the same property (the
one of the case file; no other is run) failing on every output the original
failed on, others may join (a bias verdict counts as a failure of its output
of its own kind, "dq (bias)"; an implementation that raised: the same exception
type). A harness error, a pass, or one of those outputs passing rejects it.
Others may join because a smaller case often fails more: jax's XLA attention
in TF32 fails out and dv at T=1000 and dq too at every shorter T tried, and
an exact match of the set kept that case at T=1000 (docs/PEERS.md). Moves are
tried in a fixed order until a whole round accepts none (a fixpoint), within an
attempt and a time budget, so two runs on the same machine give the same
minimal case (unless the time budget, the one non-deterministic bound, ends one
of them first).

It imports nothing from ua_kernels: the implementation is a plug-in here too.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from typing import Callable, Iterator

from ..model.capabilities import Implementation
from ..model.case import Case, write_case_file
from ..checks.checks import PropertyFailure
from ..model.profiles import BUCKETS
from ..checks.registry import Property
from ..run.verifier import CaseFailure, HarnessFailure, Verifier, replay_command

# Tile lengths whose edges (b, b + 1, 2b, 2b + 1) T is tried at, besides the
# implementation's own (ua_block_sizes) and the case's tiles: off-by-one tile
# bounds live there, so a minimal case that stays on an edge keeps its defect.
DEFAULT_TILES = (16, 32, 64, 128)
# Head dims tried, smallest first: every profile's, i.e. ones the suite draws
# (and an implementation's ua_head_dims then filters).
HEAD_DIMS = tuple(sorted({d for b in BUCKETS.values() for d in b.head_dims}))


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How one case ran: ``kind`` is passed, failed (the property's comparisons;
  ``outputs`` the failing ones), raised (the implementation or the check raised
  ``detail``) or harness (the oracle or reference could not run it)."""

  kind: str
  outputs: frozenset = frozenset()
  detail: str = ""
  errors: tuple = ()
  message: str = ""

  def keeps(self, target: "Outcome") -> bool:
    """Whether this outcome fails the way ``target`` did: the same kind, and
    every output that failed there failing here (the same exception type, for
    one that raised)."""
    if self.kind != target.kind:
      return False
    if self.kind == "failed":
      # A failure naming no output (one of the metamorphic checks') keeps
      # only another that names none.
      return self.outputs >= target.outputs if target.outputs else not self.outputs
    return self.detail == target.detail

  def describe(self) -> str:
    if self.kind == "failed":
      return f"fails on {sorted(self.outputs)}"
    if self.kind == "raised":
      return f"raises {self.detail}"
    return {"passed": "passes", "harness": "harness error"}[self.kind]


def output_name(name: str) -> str:
  """An output's name without the slice a property labels it with
  (packed_equals_separate's ``dk[b0,3:8]``): shrinking T moves the slices, not
  which output is wrong."""
  return name.split("[", 1)[0]


def run_case(verifier: Verifier, prop: Property, case: Case) -> Outcome:
  """Runs ``prop`` on ``case`` through the suite's own Verifier.check and
  classifies the result (see Outcome)."""
  try:
    verifier.check(prop, case)
  except HarnessFailure as exc:
    return Outcome("harness", message=str(exc))
  except CaseFailure as exc:
    cause = exc.__cause__
    message = f"{type(cause).__name__}: {cause}"
    if isinstance(cause, PropertyFailure):
      bad = frozenset(output_name(name) for name in exc.failed_outputs)
      return Outcome("failed", bad, errors=tuple(e.to_dict() for e in exc.errors),
                     message=message)
    return Outcome("raised", detail=type(cause).__name__, message=message)
  return Outcome("passed")


def cost(case: Case) -> int:
  """T x query heads x head dim: what the report compares (batch is shown apart)."""
  return case.seq_len * case.num_q_heads * case.head_dim


def describe_cost(case: Case) -> str:
  return (f"cost {case.seq_len}x{case.num_q_heads}x{case.head_dim}={cost(case)}"
          f" (B={case.batch}, Hkv={case.num_kv_heads})")


def why_invalid(impl: Implementation, prop: Property, case: Case) -> str | None:
  """Why the property would not be drawn on this case for this implementation
  (the registry's require/forbid/any_of/applies, the implementation's
  declarations), or None. A candidate outside them is not a case the suite
  could have produced, so it is never run."""
  declared = prop.unsupported_by(impl)
  if declared is not None:
    return declared
  features = case.features()
  if not prop.require <= features:
    return f"{prop.name} requires {sorted(prop.require - features)}"
  if prop.forbid & features:
    return f"{prop.name} is not drawn with {sorted(prop.forbid & features)}"
  if prop.any_of and not prop.any_of & features:
    return f"{prop.name} needs one of {sorted(prop.any_of)}"
  if case.num_q_heads % case.num_kv_heads:
    return f"{case.num_q_heads} query heads are not a multiple of {case.num_kv_heads}"
  unsupported = impl.supports(case)
  if unsupported is not None:
    return f"{impl.name} {unsupported}"
  return None if prop.draws(case) else f"{prop.name} does not apply to it (registry)"


def valid(impl: Implementation, prop: Property, case: Case) -> bool:
  return why_invalid(impl, prop, case) is None


# --------------------------------------------------------------------------- #
# Moves: each yields candidate cases, most reduced first. The first candidate
# that still fails the same way is taken.

def _tiles(impl: Implementation, case: Case) -> list[int]:
  return sorted(set(DEFAULT_TILES) | set(impl.block_sizes) | set(case.tiles or ()))


def smaller_seq_lens(impl: Implementation, case: Case) -> list[int]:
  """1, 2, tile edges below T (ascending), then T // 2: short sequences first,
  then those just on and past a tile, where kernels change loops."""
  t = case.seq_len
  edges = sorted({m * b + d for b in _tiles(impl, case) for m in (1, 2) for d in (0, 1)})
  out = []
  for value in [1, 2, *edges, t // 2]:
    if 1 <= value < t and value not in out:
      out.append(value)
  return out


def smaller_head_pairs(case: Case) -> list[tuple[int, int]]:
  """(Hq, Hkv) pairs with fewer heads, Hq divisible by Hkv, fewest first: fewer
  kv heads at the same group size, a smaller group (down to MHA), or both."""
  hq, hkv = case.num_q_heads, case.num_kv_heads
  group = hq // hkv
  pairs = set()
  for kv in {1, max(1, hkv // 2), hkv}:
    for g in {1, 2, max(1, group // 2), group}:
      if g * kv <= hq and g <= group and (g * kv, kv) != (hq, hkv):
        pairs.add((g * kv, kv))
  return sorted(pairs)


def _seq_len_moves(impl, case):
  for t in smaller_seq_lens(impl, case):
    yield f"T {case.seq_len} -> {t}", dataclasses.replace(case, seq_len=t)


def _batch_moves(impl, case):
  for b in sorted({1, case.batch // 2}):
    if 1 <= b < case.batch:
      yield f"batch {case.batch} -> {b}", dataclasses.replace(case, batch=b)


def _head_moves(impl, case):
  for hq, hkv in smaller_head_pairs(case):
    yield (f"heads {case.num_q_heads}/{case.num_kv_heads} -> {hq}/{hkv}",
           dataclasses.replace(case, num_q_heads=hq, num_kv_heads=hkv))


def _head_dim_moves(impl, case):
  for d in HEAD_DIMS:
    if d < case.head_dim and impl.head_dims(d):
      yield f"head dim {case.head_dim} -> {d}", dataclasses.replace(case, head_dim=d)


def _switch(label: str, applies: Callable[[Case], bool], changes: dict):
  """A move with one candidate: ``changes`` where ``applies``. Each feature is a
  move of its own, so that one round tries every feature off, not only up to
  the first accepted."""
  def move(impl, case):
    if applies(case):
      yield label, dataclasses.replace(case, **changes)
  move.__name__ = f"switch {label}"
  return move


# Features off one at a time, in Case field order; then simpler values.
SWITCHES = (
    _switch("causal off", lambda c: c.causal, dict(causal=False)),
    _switch("window off", lambda c: c.window_len != 0, dict(window_len=0)),
    _switch("segment ids off", lambda c: c.segments != "none", dict(segments="none")),
    _switch("cap off", lambda c: c.cap_method != "none", dict(cap_method="none", cap_params=())),
    _switch("temperature off", lambda c: c.temperature != "none", dict(temperature="none")),
    _switch("sm_scale default", lambda c: c.sm_scale is not None, dict(sm_scale=None)),
    _switch("z-loss off", lambda c: c.z_loss_weight != 0, dict(z_loss_weight=0.0)),
    _switch("lse off", lambda c: c.return_lse, dict(return_lse=False)),
    _switch("segment ids wide -> packed", lambda c: c.segments == "wide",
            dict(segments="packed")),
    _switch("segment ids random -> packed", lambda c: c.segments == "random",
            dict(segments="packed")),
    _switch("temperature -> uniform", lambda c: c.temperature in ("extreme", "signed"),
            dict(temperature="uniform")),
    _switch("distribution -> normal", lambda c: c.distribution != "normal",
            dict(distribution="normal")),
)

MOVES: tuple[Callable[[Implementation, Case], Iterator[tuple[str, Case]]], ...] = (
    _seq_len_moves, _batch_moves, _head_moves, _head_dim_moves, *SWITCHES)


# --------------------------------------------------------------------------- #

@dataclasses.dataclass
class Result:
  """The smallest case found, its outcome, and how the search went."""

  case: Case
  outcome: Outcome
  attempts: int
  seconds: float
  stopped: str  # fixpoint | max attempts | max seconds | interrupted


def minimize(impl: Implementation, prop: Property, case: Case, target: Outcome, *,
             verifier: Verifier, max_attempts: int = 200, max_seconds: float = 600.0,
             log: Callable[[str], None] = print) -> Result:
  """Greedy reduction of ``case`` while it fails as ``target`` did (Outcome.keeps).

  Rounds over MOVES; in each move the first candidate failing the same way is
  taken. Outcomes are remembered per case, so a candidate rejected in one round
  costs nothing when the next proposes it again. Ends at a round with no
  accepted move, when the attempts or seconds are spent, or at Ctrl-C (the
  smallest case so far is still written).
  """
  start, attempts, seen = time.monotonic(), 0, {case: target}
  best, best_outcome = case, target
  progress = True
  while progress:
    progress = False
    for move in MOVES:
      for what, candidate in move(impl, best):
        if not valid(impl, prop, candidate):
          continue
        outcome = seen.get(candidate)
        if outcome is None:
          spent = ("max attempts" if attempts >= max_attempts else
                   "max seconds" if time.monotonic() - start >= max_seconds else None)
          if spent:
            return Result(best, best_outcome, attempts, time.monotonic() - start, spent)
          attempts += 1
          try:
            outcome = seen[candidate] = run_case(verifier, prop, candidate)
          except KeyboardInterrupt:  # keep what was found so far
            return Result(best, best_outcome, attempts - 1, time.monotonic() - start,
                          "interrupted")
          same = outcome.keeps(target)
          log(f"[{attempts:3}] {what:34} {'accepted' if same else 'rejected'}: "
              f"{outcome.describe()}; {describe_cost(candidate)}")
        if outcome.keeps(target):
          best, best_outcome, progress = candidate, outcome, True
          break
  return Result(best, best_outcome, attempts, time.monotonic() - start, "fixpoint")


def minimized_path(path: str) -> str:
  """``<name>.min.json`` beside ``<name>.json``."""
  root, ext = os.path.splitext(path)
  return f"{root}.min{ext or '.json'}"


def minimize_file(path: str, payload: dict, impl: Implementation, prop: Property, *,
                  imports=(), max_attempts: int = 200, max_seconds: float = 600.0,
                  log: Callable[[str], None] = print) -> int:
  """ua-repro --minimize on one loaded case file. Returns ua-repro's status: 1
  when the (minimal) case fails, 0 when the recorded one does not reproduce
  here, 2 when there is nothing to minimize: the harness cannot evaluate the
  case, or it is outside what the suite draws for this property and
  implementation."""
  case = payload["case"]
  with tempfile.TemporaryDirectory(prefix="ua-minimize-") as scratch:
    verifier = Verifier(impl, scratch, tuple(imports))
    invalid = why_invalid(impl, prop, case)
    if invalid:
      log(f"not minimized: the case is outside what the suite draws ({invalid}), and so "
          f"would be every candidate; ua-repro without --minimize replays it as it is")
      return 2
    target = run_case(verifier, prop, case)
    log(f"original: {prop.name} {target.describe()}; {describe_cost(case)}")
    if target.kind == "passed":
      log("PASS: does not reproduce here: nothing to minimize")
      return 0
    if target.kind == "harness":
      log(f"harness error on the original case: nothing to minimize\n{target.message}")
      return 2
    result = minimize(impl, prop, case, target, verifier=verifier,
                      max_attempts=max_attempts, max_seconds=max_seconds, log=log)
  out = minimized_path(path)
  replay = replay_command(out, impl.name, tuple(imports))
  write_case_file(out, result.case, prop.name, impl.name, status="failed",
                  errors=result.outcome.errors, message=result.outcome.message,
                  imports=tuple(imports), replay=replay)
  ratio = cost(case) / cost(result.case)
  log(f"stopped: {result.stopped} after {result.attempts} attempts in "
      f"{result.seconds:.0f} s\nminimal case: {result.case}\n{prop.name} "
      f"{result.outcome.describe()}; {describe_cost(result.case)}, {ratio:.1f}x cheaper\n"
      f"written to {out}\nreplay: {replay}")
  return 1
