"""Suite options: --impl (implementation under test) and Hypothesis profiles.

Profiles (select with --hypothesis-profile): ci (default; derandomized,
bounded), dev, fuzz (randomized, long, example database, targets the
error/tolerance ratio), gpu (compiled kernels, real block sizes, T up to 16k).
"""

import importlib
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture]
settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, max_examples=10,
    suppress_health_check=_SLOW_OK, phases=[Phase.explicit, Phase.generate],
    print_blob=True)
settings.register_profile(
    "dev", deadline=None, max_examples=25, suppress_health_check=_SLOW_OK,
    print_blob=True)
settings.register_profile(
    "fuzz", deadline=None, max_examples=500, suppress_health_check=_SLOW_OK,
    database=DirectoryBasedExampleDatabase(".hypothesis/ua-fuzz"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    print_blob=True)
settings.register_profile(
    "gpu", deadline=None, max_examples=12, suppress_health_check=_SLOW_OK,
    derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
    print_blob=True)
settings.load_profile(os.environ.get("UA_PROFILE", "ci"))

# Modules that register extra cap methods (docs/ADDING_A_CAP_METHOD.md).
for _module in filter(None, os.environ.get("UA_IMPORT", "").split(",")):
  importlib.import_module(_module.strip())


def pytest_addoption(parser):
  parser.addoption("--impl", default=os.environ.get("UA_IMPL", "ua_kernels:attention"),
                   help="implementation under test, as module:function")


@pytest.fixture(scope="session")
def impl_name(request):
  return request.config.getoption("--impl")


@pytest.fixture(scope="session")
def impl(impl_name):
  from properties.impls import load_impl
  return load_impl(impl_name)


@pytest.fixture(scope="session")
def profile_name():
  return settings._current_profile or "ci"


@pytest.fixture(scope="session")
def buckets(profile_name):
  from properties.strategies import BUCKETS
  return BUCKETS.get(profile_name, BUCKETS["ci"])
