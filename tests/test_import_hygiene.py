"""The contract and the suite load neither the kernels nor Pallas: the oracle
cannot be broken by the code it judges, and the suite can verify any kernel
in an environment where ours would not even import."""

import subprocess
import sys

MODULES = ["ua_reference", "properties", "properties.plugin", "properties.suite",
           "properties.cli", "properties.registry", "properties.verifier",
           "properties.strategies", "properties.runner", "properties.cap_checks",
           "properties.impls", "properties.calibrate", "properties.mutation",
           "properties.minimize"]

SCRIPT = f"""
import sys
for name in {MODULES!r}:
  __import__(name)
# Using them too: the reference as an implementation, through the suite's runner.
from properties.capabilities import load_impl
from properties.case import Case
from properties.checks import matches_oracle
matches_oracle(load_impl("ua_reference:attention"),
               Case(batch=1, seq_len=7, num_q_heads=2, num_kv_heads=1, head_dim=16,
                    dtype="bfloat16", causal=True, cap_method="tanh", cap_params=(1.0,)))
bad = sorted(m for m in sys.modules if m == "ua_kernels" or m.startswith("ua_kernels.")
             or m.startswith("jax.experimental.pallas"))
print("LOADED", bad)
"""


def test_spec_and_suite_import_no_kernels_and_no_pallas():
  proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "LOADED []" in proc.stdout, proc.stdout


def test_the_plugin_loads_nothing_heavy():
  """The pytest11 entry point loads properties.plugin into every pytest session
  of the environment: it must not pull in jax, numpy, Hypothesis or the suite."""
  proc = subprocess.run([sys.executable, "-c", (
      "import sys, properties.plugin\n"
      "print('LOADED', sorted(m for m in ('jax', 'numpy', 'hypothesis', 'ua_reference',"
      " 'properties.strategies') if m in sys.modules))")],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "LOADED []" in proc.stdout, proc.stdout
