"""The contract and the suite load neither the kernels nor Pallas: the oracle
cannot be broken by the code it judges, and the suite can verify any kernel
in an environment where ours would not even import.

The suite's sub-packages are layers (properties/*/__init__.py say what each
holds): a layer imports only the layers below it, so that what a case is
(model) and how its outputs are judged (judge) never depend on how a campaign
runs them."""

import ast
import pathlib
import pkgutil
import subprocess
import sys

import properties

PACKAGE = pathlib.Path(properties.__file__).parent

# What each part of the suite may import of the others, besides itself.
LAYERS = {
    "model": set(),
    "judge": {"model"},
    "checks": {"model", "judge"},
    "run": {"model", "judge", "checks"},
    "peers": {"model"},
    "campaign": {"model", "judge", "checks", "run"},
    "cli": {"model", "judge", "checks", "run", "campaign"},
    "plugin": {"campaign"},
    "suite": set(),
}

# Every module of the suite but the adapters of others' Pallas kernels (imported
# by properties.peers.impls only when such a peer is loaded).
PALLAS_PEERS = ("properties.peers.impls_splash", "properties.peers.impls_tokamax")
MODULES = ["ua_reference", "benchmarks.mutation"] + [
    m.name for m in pkgutil.walk_packages([str(PACKAGE)], "properties.")
    if not m.name.endswith("__main__") and m.name not in PALLAS_PEERS]

SCRIPT = f"""
import sys
for name in {MODULES!r}:
  __import__(name)
# Using them too: the reference as an implementation, through the suite's runner.
from properties.model.capabilities import load_impl
from properties.model.case import Case
from properties.checks.checks import matches_oracle
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
      " 'properties.model.strategies') if m in sys.modules))")],
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "LOADED []" in proc.stdout, proc.stdout


def _imports(root: pathlib.Path = PACKAGE, ours=("properties",)) -> dict[str, set[str]]:
  """Every module of the package at ``root`` and the modules of ``ours`` it imports, at
  module level or inside a function (a lazy import is a dependency too)."""
  out = {}
  for path in sorted(root.rglob("*.py")):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    package = parts[:-1]  # a module's package, or an __init__'s own
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom):
        base = package[:len(package) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        if not module.startswith(ours):
          continue
        found.add(module)
        for alias in node.names:  # a module imported from its package
          path = root.parent / f"{module}.{alias.name}".replace(".", "/")
          if path.is_dir() or path.with_suffix(".py").exists():
            found.add(f"{module}.{alias.name}")
      elif isinstance(node, ast.Import):
        found.update(a.name for a in node.names if a.name.startswith(ours))
    out[name] = found - {name}
  return out


def _layer(module: str) -> str | None:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def test_each_layer_imports_only_the_layers_below_it():
  wrong = []
  for module, imported in _imports().items():
    layer = _layer(module)
    if layer is None:
      continue
    assert layer in LAYERS, f"{module}: a part of the suite that LAYERS does not place"
    for other in imported:
      to = _layer(other)
      if to is not None and to != layer and to not in LAYERS[layer]:
        wrong.append(f"{module} imports {other}")
  assert not wrong, wrong


def test_the_suite_has_no_import_cycle():
  graph = _imports()
  done, path = set(), []

  def visit(module):
    if module in path:
      raise AssertionError(" -> ".join(path[path.index(module):] + [module]))
    if module in done:
      return
    path.append(module)
    for other in sorted(graph.get(module, ())):
      visit(other)
    path.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def test_no_module_of_the_suite_is_over_400_lines():
  long = {str(p.relative_to(PACKAGE.parent)): n for p in PACKAGE.rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 400}
  assert not long, long


def test_kernels_use_the_contract_not_the_oracle_and_no_backend_uses_the_other():
  """ua_kernels depends on the contract (ua_reference.contract, caps), never on
  the oracle that judges it (ua_reference.reference); each backend's package
  (ua_kernels.triton, ua_kernels.mosaic) uses the shared modules, not the other
  backend, so that either can change alone."""
  import ua_kernels
  kernels = pathlib.Path(ua_kernels.__file__).parent
  wrong = []
  for module, imported in _imports(kernels, ("ua_kernels", "ua_reference")).items():
    for other in imported:
      if other in ("ua_reference", "ua_reference.reference"):
        wrong.append(f"{module} imports the oracle ({other})")
      for one, two in (("triton", "mosaic"), ("mosaic", "triton")):
        if module.startswith(f"ua_kernels.{one}") and other.startswith(f"ua_kernels.{two}"):
          wrong.append(f"{module} imports {other}")
  assert not wrong, wrong


def test_no_module_of_the_kernels_is_over_600_lines():
  """A kernel file holds one kernel family (JAX's Pallas ops: one file per
  kernel); the Mosaic backward's dq and dk/dv kernels are files of their own."""
  import ua_kernels
  kernels = pathlib.Path(ua_kernels.__file__).parent
  long = {str(p.relative_to(kernels.parent)): n for p in kernels.rglob("*.py")
          if (n := len(p.read_text().splitlines())) > 600}
  assert not long, long
