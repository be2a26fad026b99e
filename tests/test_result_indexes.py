"""The result indexes (benchmarks/results/README.md, docs/verification/README.md)
list every result file with its own provenance: a file added without rerunning
``python -m benchmarks.index`` fails here. Reads files only; no jax."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import index

ROOT = Path(__file__).resolve().parent.parent


def test_committed_indexes_are_current():
  result = subprocess.run([sys.executable, "-m", "benchmarks.index", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr


@pytest.fixture
def copy(tmp_path, monkeypatch):
  """The two result folders and their indexes copied under tmp_path, the
  generator pointed there."""
  for folder in ("benchmarks/results", "docs/verification/h200", "docs/verification/cpu"):
    shutil.copytree(ROOT / folder, tmp_path / folder)
  shutil.copy(ROOT / "docs/verification/README.md", tmp_path / "docs/verification/README.md")
  monkeypatch.setattr(index, "ROOT", tmp_path)
  return tmp_path


def test_a_new_file_without_a_row_fails_the_check(copy, capsys):
  new = copy / "benchmarks/results/h200/2099-01-01-abcdef0-bench-quick.json"
  new.write_text(json.dumps({"commit": "abcdef0", "command": "ua-bench --set quick"}))
  assert index.main(["--check"]) == 1
  assert "no row for h200/2099-01-01-abcdef0-bench-quick.json" in capsys.readouterr().err
  assert index.main([]) == 0
  assert index.main(["--check"]) == 0
  row = index._rows_by_file((copy / "benchmarks/results/README.md").read_text())[
      "h200/2099-01-01-abcdef0-bench-quick.json"]
  # What the file lacks is "—", not taken from its name.
  assert row.split(" | ")[1:] == ["—", "`abcdef0`", "`quick`", "`ua-bench --set quick`", "—",
                                  "—", "— |"]


def test_a_changed_file_makes_its_row_stale_and_the_prose_is_kept(copy, capsys):
  path = copy / "docs/verification/h200/2026-12-01-903a4aa-campaign-gpu-1gpu.json"
  data = json.loads(path.read_text())
  data["seconds"] = 1.0
  path.write_text(json.dumps(data))
  assert index.main(["--check"]) == 1
  assert ("stale row for h200/2026-12-01-903a4aa-campaign-gpu-1gpu.json"
          in capsys.readouterr().err)
  readme = copy / "docs/verification/README.md"
  header, footer = index._split(readme.read_text())
  assert index.main([]) == 0
  assert index._split(readme.read_text()) == (header, footer)
  assert "357 cases, 350 oracle, 0 failed, 1.0 s" in readme.read_text()


def test_a_removed_file_is_named(copy, capsys):
  (copy / "docs/verification/cpu/2026-12-01-cf51d63-mutants.txt").unlink()
  assert index.main(["--check"]) == 1
  assert "row for cpu/2026-12-01-cf51d63-mutants.txt, which is not a file there" in (
      capsys.readouterr().err)
