"""The property tests of the suite, for any implementation:

    pytest --pyargs properties.suite --impl mypkg.mod:fn [--hypothesis-profile ua-dev]

One test per property of properties/checks/registry.py (per dtype, and in chunks under
the gpu profile, for the oracle property); the plugin parametrizes them
(properties/campaign/schedule.py) and provides the ``ua_suite`` fixture
(properties/campaign/session.py).
"""


def test_property(ua_suite, ua_property_test, request):
  ua_suite.run(ua_property_test, request.node)
