"""Every mutant of ua-mutate still applies to the current kernel source.

CI replays a rotating subset of the mutants (docs/MUTATION.md); one whose text no
longer matches exactly once would fail only the CI run that draws it. This checks
them all, in a second, on every run.
"""

import pytest

from properties.mutation import MUTANTS, _scratch_copy, apply


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.id for m in MUTANTS])
def test_mutant_applies(mutant):
  root = _scratch_copy(mutant)
  before = (root / mutant.file).read_text()
  apply(mutant, root)
  assert (root / mutant.file).read_text() != before
