"""The suite as a pytest plugin (entry point ``pytest11``; docs/PLUGINS.md).

Installing unified-attention registers it in every pytest session of that
environment. There it adds options, fixtures and the ``ua-*`` Hypothesis
profiles (when Hypothesis is installed) and imports nothing else — no jax, no
suite — until the suite's tests are collected: ``pytest --pyargs
properties.suite --impl mypkg.mod:fn``. Options:

  --impl MODULE:FUNCTION      implementation under test (default ua_kernels:attention)
  --ua-import MODULES         comma-separated modules that register cap methods
  --ua-report PATH            JSON report by feature group and property
  --ua-failures DIR           where case files go (default ua-failures)
  --ua-case-timeout SECONDS   a case running longer ends its worker, reported as a failure
                              (default: the profile's base plus the case's size share)
  --ua-minutes M              time box: no case starts after it
  --ua-database DIR|URL       Hypothesis example database (failures replay first)
  --ua-shared-database DIR|URL  combined with it: a directory read only, a Redis
                              URL (redis://HOST:PORT/DB) read and written, shared
                              by campaigns on several hosts (properties/campaign/databases.py)
  --ua-compile-cache DIR      JAX's persistent compilation cache
  --ua-compile-threads N      compile an oracle case's four executables on N threads at once
  --ua-seeds N                input seeds per drawn configuration (default: the profile's)
  --ua-save-baseline FILE     every case's error/tolerance per output, for --ua-baseline
  --ua-baseline FILE          fail when errors grew significantly against it
                              (properties/judge/gates.py)

Profiles: ``--hypothesis-profile ua-ci|ua-dev|ua-fuzz|ua-gpu`` (properties/model/profiles.py).
The report is built from the test reports' ``user_properties`` (one entry per
case run), so it works the same under pytest-xdist.

This module is the entry point only: the hooks and fixtures live in
properties/campaign/ (options, schedule, session, hooks, report), and pytest
finds them here by name.
"""

from .campaign.hooks import (pytest_configure, pytest_configure_node, pytest_runtest_logreport,
                             pytest_sessionfinish, pytest_terminal_summary)
from .campaign.options import pytest_addoption
from .campaign.schedule import pytest_generate_tests
from .campaign.session import ua_impl, ua_suite

__all__ = ["pytest_addoption", "pytest_configure", "pytest_configure_node",
           "pytest_generate_tests", "pytest_runtest_logreport", "pytest_sessionfinish",
           "pytest_terminal_summary", "ua_impl", "ua_suite"]
