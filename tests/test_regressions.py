"""Replays every saved case in tests/regressions/ against --impl.

Each file is a case JSON (as written on failure; see docs/DEFECTS.md): the
property that caught a defect and the exact input, so it stays caught.
"""

from pathlib import Path

import pytest

from properties.case import load_case_file
from properties.checks import run_property
from properties.impls import unsupported

CASES = sorted((Path(__file__).parent / "regressions").glob("*.json"))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_regression_case(path, impl, impl_name):
  payload = load_case_file(path)
  case = payload["case"]
  missing = case.features() & unsupported(impl)
  if missing:
    pytest.skip(f"implementation declares {sorted(missing)} unsupported")
  run_property(payload["property"], impl, impl_name, case)
