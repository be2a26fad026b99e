"""This repository's own test configuration.

The suite's options (--impl, --ua-*), fixtures and profiles come from the
installed package's pytest plugin (properties/plugin.py, entry point
``pytest11``), the same plugin any user's CI loads; nothing is configured here
that an installed suite would lack. Kernel unit tests that need a KernelConfig
build their own.
"""

# The tests of a minute and more (a whole suite run in a subprocess, the oracle property of one
# dtype) start first: run in file order, the longest came late and one worker of `pytest -n 2`
# ran the last of them alone (README.md, "Tests").
_LONG_FIRST = (
    "tests/test_context_parallel.py::test_the_suite_verifies_the_sharded_op_over_virtual_devices",
    "tests/test_clients.py::test_splash_attention_runs_under_the_suite_in_interpret_mode",
    "tests/test_context_parallel.py::test_sharded_matches_the_single_device_call",
    "tests/test_properties.py::test_property[matches_oracle-",
    "tests/test_properties.py::test_property[packed_equals_separate]",
    "tests/test_gates.py::test_a_run_fails_a_planted_bias_and_a_planted_precision_regression",
    "tests/test_minimize.py::test_minimize_a_planted_defect_end_to_end",
    "tests/test_clients.py::test_a_narrow_kernel_is_drawn_at_its_own_head_dims_and_tiles",
    "tests/test_properties.py::test_property[matches_oracle_under_x64]",
)


def pytest_collection_modifyitems(items):
  def rank(item):
    return next((i for i, prefix in enumerate(_LONG_FIRST) if item.nodeid.startswith(prefix)),
                len(_LONG_FIRST))
  items.sort(key=rank)  # stable: the rest keep their order
