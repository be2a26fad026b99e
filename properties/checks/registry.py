"""The one registry of properties: what each checks and which cases it is drawn on.

The suite's test module (properties/suite.py), ua-verify, ua-fuzz and the
plugin tests all read PROPERTIES. A property is drawn only on cases where it
applies, so none passes without comparing something (the verifier also
refuses a check that returns no comparison).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Callable

from ua_reference.caps import CAP_METHODS

from . import checks, length_checks, mask_check, rerun_checks
from ..judge.runner import Harness
from ..model.case import Case


def _always(case: Case) -> bool:
  return True


def _itself(case: Case) -> Case:
  return case


@dataclasses.dataclass(frozen=True)
class Property:
  """One property: ``check(impl, case)``, the features a case must have
  (``require``), must not have (``forbid``) and of which it must have at least
  one (``any_of``), when it applies beyond those (``applies``), its example
  budget in the ci profile, and whether it runs as one test per dtype.

  A check that scores against the oracle takes a third parameter,
  ``harness=None``: the verifier builds the Harness of the case it judges
  (``judged``), once, and passes it; called without one, the check builds its
  own. A check of the plain ``(impl, case)`` form gets none, and the verifier
  builds none for it (docs/PLUGINS.md, "The property registry")."""

  name: str
  check: Callable
  examples: int
  require: frozenset = frozenset()
  forbid: frozenset = frozenset()
  any_of: frozenset = frozenset()
  applies: Callable[[Case], bool] = _always
  per_dtype: bool = False
  oracle: bool = False  # compares with the float64 oracle (counts as an oracle case)
  x64: bool = False  # calls the implementation with jax_enable_x64 on
  uses_cap_method: str | None = None  # a cap method the check itself calls with
  # Features of the calls the check derives (a key block's offset), which the
  # implementation must take although the drawn case need not have them.
  uses_features: frozenset = frozenset()
  # The case whose harness the check scores against: the drawn case, or one it
  # derives (huge_tanh_cap_is_no_cap scores against its no-cap case).
  judged: Callable[[Case], Case] = _itself
  # Whether a case's input seed changes what the check sees, so that further
  # seeds of one compiled configuration are further evidence, not repeats.
  seed_matters: Callable[[Case], bool] = _always
  # Whether it compares the implementation with its declared single-device
  # counterpart (ua_unsharded), which only a sharded op declares.
  needs_unsharded: bool = False
  # For implementations whose reruns are (True) or are not (False) bitwise identical
  # (ua_deterministic); None: every implementation.
  for_deterministic: bool | None = None
  # Whether the check judges a case whose harness holds sampled rows alone
  # (Case.sampled_rows; Harness.judged): one that indexes the harness's bounds
  # by rows of its own needs every row, and draws no such case.
  sampled_rows_ok: bool = False

  def draws(self, case: Case) -> bool:
    """Whether the property runs on ``case``: it applies, and a case judged on
    sampled rows goes only to a check that takes no harness or judges them."""
    return self.applies(case) and (not case.sampled_rows or self.sampled_rows_ok
                                   or not self.takes_harness)

  @property
  def takes_harness(self) -> bool:
    """Whether the check takes a ``harness``: only then is one built for it, so
    a check with inputs of its own, or an exact comparison, skips that cost."""
    return "harness" in inspect.signature(self.check).parameters

  def run(self, impl, case: Case, harness: Harness | None = None):
    """The check on ``case``, handed ``harness`` (``judged(case)``'s) if it takes one."""
    if harness is not None and self.takes_harness:
      return self.check(impl, case, harness=harness)
    return self.check(impl, case)

  def unsupported_by(self, impl, dtype: str | None = None) -> str | None:
    """Why ``impl`` (with its declarations) cannot run this property, or None.
    The one place that decides; the strategies then draw within what remains."""
    if self.needs_unsharded and impl.unsharded is None:
      return f"{impl.name} declares no ua_unsharded (it is not a sharded op)"
    if self.for_deterministic is not None and impl.deterministic != self.for_deterministic:
      return (f"{impl.name} declares ua_deterministic={impl.deterministic}: its reruns are "
              f"judged by " + ("reruns_within_tolerance" if self.for_deterministic
                               else "deterministic"))
    missing = (set(self.require) | self.uses_features) & impl.unsupported
    if missing:
      return f"{impl.name} {impl.lacks(missing)}"
    if self.any_of and self.any_of <= (impl.unsupported | self.forbid):
      return f"{impl.name} supports none of {sorted(self.any_of)}"
    if dtype is not None and dtype not in impl.dtypes:
      return f"{impl.name} declares dtypes {impl.dtypes}"
    if self.uses_cap_method and not (self.uses_cap_method in CAP_METHODS
                                     and impl.supports_cap(self.uses_cap_method)):
      return f"needs cap method {self.uses_cap_method!r}, unregistered or unsupported"
    return None


def _longer_than_one(case: Case) -> bool:
  return case.seq_len > 1


def _hides_a_key(case: Case) -> bool:
  return checks.hidden_key_sets(case) is not None


def _mask_affordable(case: Case) -> bool:
  """The exact mask costs T / D full-attention calls: float32 at T = 16384 took
  157 s of a 3-minute H200 campaign's 276 (its kernels run at float32 speed),
  so float32 is drawn up to MASK_FLOAT32_MAX_T; longer float32 runs under the
  oracle and the hidden-key properties (docs/VERIFICATION.md, "The box's end")."""
  return case.dtype != "float32" or max(case.seq_len, case.tk) <= MASK_FLOAT32_MAX_T


MASK_FLOAT32_MAX_T = 8191


def _contiguous_documents(case: Case) -> bool:
  """Documents that are runs of distinct ids: a wide case's distant documents
  may share an id, and so see each other, unlike the same documents alone."""
  return case.segments == "packed"


def _has_documents(case: Case) -> bool:
  """The exact mask's inputs are fixed one-hot encodings: only the segment ids,
  drawn from the seed, vary with it."""
  return case.segments != "none"


PROPERTIES = (
    Property("matches_oracle", checks.matches_oracle, 15, per_dtype=True, oracle=True),
    Property("matches_oracle_under_x64", checks.matches_oracle_under_x64, 6, oracle=True,
             x64=True),
    Property("key_permutation_invariance", checks.key_permutation_invariance, 4,
             forbid=frozenset({"causal", "window", "segment_ids"}), applies=_longer_than_one),
    Property("packed_equals_separate", checks.packed_equals_separate, 4,
             require=frozenset({"segment_ids"}), applies=_contiguous_documents,
             forbid=frozenset({"kv_length", "q_offset", "sinks"})),
    # Clean against poisoned runs of the implementation, compared exactly: no oracle.
    Property("hidden_keys_do_not_leak", checks.hidden_keys_do_not_leak, 5,
             any_of=frozenset({"causal", "window", "segment_ids"}), applies=_hides_a_key,
             forbid=frozenset({"kv_length", "q_offset"})),
    Property("mask_is_exact", mask_check.mask_is_exact, 4,
             applies=_mask_affordable, seed_matters=_has_documents,
             forbid=frozenset({"sinks"})),
    Property("zero_z_loss_is_no_z_loss", checks.zero_z_loss_is_no_z_loss, 3,
             judged=checks.without_z_loss),
    Property("unit_temperature_is_none", checks.unit_temperature_is_none, 3,
             require=frozenset({"temperature"}), judged=checks.without_temperature),
    Property("huge_tanh_cap_is_no_cap", checks.huge_tanh_cap_is_no_cap, 3,
             require=frozenset({"cap"}), uses_cap_method="tanh", judged=checks.without_cap),
    Property("window_covering_sequence_is_no_window",
             checks.window_covering_sequence_is_no_window, 3, require=frozenset({"window"}),
             judged=checks.without_window),
    Property("gqa_equals_repeated_heads", checks.gqa_equals_repeated_heads, 4,
             require=frozenset({"gqa"})),
    Property("deterministic", rerun_checks.deterministic, 3, for_deterministic=True),
    Property("reruns_within_tolerance", rerun_checks.reruns_within_tolerance, 3,
             for_deterministic=False),
    # Queries and keys of other lengths, and sinks (properties/checks/length_checks.py).
    Property("queries_equal_their_rows_of_the_full_call",
             length_checks.queries_equal_their_rows_of_the_full_call, 3,
             require=frozenset({"kv_length"}), applies=length_checks.rows_inside_the_keys),
    Property("key_blocks_merge_to_one_call", length_checks.key_blocks_merge_to_one_call, 3,
             require=frozenset({"lse"}), applies=length_checks.two_key_blocks,
             uses_features=frozenset({"kv_length", "q_offset", "kv_segment_ids"})),
    Property("minus_inf_sinks_are_no_sinks", length_checks.minus_inf_sinks_are_no_sinks, 2,
             require=frozenset({"sinks"}), judged=length_checks.without_sinks),
    Property("sink_is_an_extra_key", length_checks.sink_is_an_extra_key, 2,
             require=frozenset({"sinks"}),
             forbid=frozenset({"cap", "temperature", "window", "segment_ids"}),
             applies=length_checks.finite_sinks_before_every_query,
             judged=length_checks.with_sink_channel,
             uses_features=frozenset({"kv_length"})),
    Property("sharded_equals_unsharded", checks.sharded_equals_unsharded, 4,
             needs_unsharded=True),
)
# Every built-in check that takes a harness judges sampled rows (Harness.score and judged
# slice what it compares), but packed_equals_separate, which slices the bounds by documents.
PROPERTIES = tuple(dataclasses.replace(p, sampled_rows_ok=p.name != "packed_equals_separate")
                   for p in PROPERTIES)
BY_NAME = {p.name: p for p in PROPERTIES}


def get(name: str) -> Property:
  try:
    return BY_NAME[name]
  except KeyError:
    raise ValueError(f"unknown property {name!r}; known: {sorted(BY_NAME)}") from None
