"""The suite's property tests (properties/suite.py), run against --impl.

The same test module an installed suite runs with
``pytest --pyargs properties.suite``; imported here so that this repository's
``pytest`` runs it beside the unit tests.
"""

from properties.suite import test_property  # noqa: F401
