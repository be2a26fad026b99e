"""Replays every saved case in tests/regressions/ against --impl.

Each file is a case JSON (as written on failure; see docs/DEFECTS.md): the
property that caught a defect and the exact input, so it stays caught. A file
marked ``"scale": "gpu"`` is too large for the CPU interpreter (minutes and
tens of GiB) and replays where a GPU is present.
"""

from pathlib import Path

import jax
import pytest

from properties.model.case import load_case_file
from properties.checks.registry import get
from properties.run.verifier import Verifier

CASES = sorted((Path(__file__).parent / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_regression_case(path, ua_impl, request):
  payload = load_case_file(path)
  if payload.get("scale") == "gpu" and jax.default_backend() != "gpu":
    pytest.skip("a GPU-scale case (T, heads): replayed where a GPU is present")
  case = payload["case"]
  why = ua_impl.supports(case)
  if why:
    pytest.skip(f"{ua_impl.name} {why}")
  Verifier(ua_impl, request.config.getoption("ua_failures")).check(get(payload["property"]), case)
