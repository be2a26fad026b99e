"""Reruns: two identical calls of an implementation, held to bit equality, or,
where it declares its reruns not bitwise identical (``ua_deterministic =
False``: reductions the hardware orders), to its tolerance."""

from __future__ import annotations

import numpy as np

from ..judge.runner import Harness, evaluate
from ..judge.tolerance import compare
from ..model.case import Case
from ..model.inputs import make_inputs
from .checks import PropertyFailure, _judging, _require


def reruns_within_tolerance(impl, case: Case, harness: Harness | None = None):
  """For an implementation that declares its reruns not bitwise identical
  (ua_deterministic = False: its reductions ordered by the hardware), two
  identical calls differ by no more than two of the case's tolerances, as a
  reordering of its sums may; a race that drops a term does not stay within
  them. The errors report the largest difference."""
  inputs = make_inputs(case)
  first, second = evaluate(impl, case, inputs), evaluate(impl, case, inputs)
  return _require(_judging(harness, case).score(second, expected=first, slack=2.0),
                  "two identical calls differ by more than a reordering of their sums")


def deterministic(impl, case: Case):
  """Two identical calls are bit-identical."""
  inputs = make_inputs(case)
  first, second = evaluate(impl, case, inputs), evaluate(impl, case, inputs)
  errors = [compare(name, second[name], x, 0.0, 0.0) for name, x in first.items()
            if x is not None]
  for e in errors:
    if not np.array_equal(first[e.name], second[e.name], equal_nan=True):
      raise PropertyFailure(f"two identical calls differ in {e.name}", errors)
  return errors
