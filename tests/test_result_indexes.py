"""The result folders (benchmarks/results/, docs/verification/h200, cpu, tpu) keep the
newest report of each kind of run, compressed, and a generated summary table of them
(benchmarks/results/README.md, docs/verification/README.md): a report added without
``python -m benchmarks.index --prune`` fails here. Reads files only; no jax."""

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import index

ROOT = Path(__file__).resolve().parent.parent
NEWEST_COLD = "h200/2026-12-06-2dff5b0-campaign-gpu-1gpu-3min-cold.json.gz"


def test_committed_summaries_are_current():
  result = subprocess.run([sys.executable, "-m", "benchmarks.index", "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr


def test_every_kept_report_has_a_kind_and_is_the_newest_of_it():
  for ix in index.INDEXES:
    for path in index.files(ix):
      assert index.kind_of(ix, path) is not None, path
      assert path.name.endswith((".json.gz", ".txt")), path
    assert all(len(paths) == 1 for paths in index.grouped(ix).values())


@pytest.fixture
def copy(tmp_path, monkeypatch):
  """The result folders and their summaries copied under tmp_path, the generator
  pointed there."""
  for folder in ("benchmarks/results", "docs/verification/h200", "docs/verification/cpu",
                 "docs/verification/tpu"):
    shutil.copytree(ROOT / folder, tmp_path / folder)
  shutil.copy(ROOT / "docs/verification/README.md", tmp_path / "docs/verification/README.md")
  monkeypatch.setattr(index, "ROOT", tmp_path)
  return tmp_path


def test_a_newer_report_supersedes_the_kept_one(copy, capsys):
  new = copy / "docs/verification/h200/2099-01-01-abcdef0-campaign-gpu-1gpu-3min-cold.json"
  new.write_text(json.dumps({"commit": "abcdef0", "command": "ua-verify --profile gpu",
                             "cases": 10, "oracle_cases": 8, "feature_groups": {},
                             "failures": [], "seconds": 60.0}))
  assert index.main(["--check"]) == 1
  err = capsys.readouterr().err
  assert "h200/2099-01-01-abcdef0-campaign-gpu-1gpu-3min-cold.json is not compressed" in err
  assert f"{NEWEST_COLD} is superseded by h200/2099-01-01-abcdef0" in err
  assert index.main(["--prune"]) == 0
  assert index.main(["--check"]) == 0
  assert not (copy / "docs/verification" / NEWEST_COLD).exists()
  kept = copy / "docs/verification/h200/2099-01-01-abcdef0-campaign-gpu-1gpu-3min-cold.json.gz"
  assert json.loads(gzip.decompress(kept.read_bytes()))["cases"] == 10
  row = index._rows_by_file((copy / "docs/verification/README.md").read_text())[
      "h200/2099-01-01-abcdef0-campaign-gpu-1gpu-3min-cold.json.gz"]
  # What the file lacks is "—", not taken from its name.
  assert row.split(" | ")[2:] == ["—", "`abcdef0`", "`ua-verify --profile gpu`", "—", "—",
                                  "10 cases, 8 oracle, 0 failed, 60.0 s |"]


def test_an_older_report_is_named_superseded(copy, capsys):
  old = copy / "benchmarks/results/h200/2000-01-01-abcdef0-bench-features.json.gz"
  old.write_bytes(gzip.compress(json.dumps({"commit": "abcdef0"}).encode()))
  assert index.main(["--check"]) == 1
  assert "h200/2000-01-01-abcdef0-bench-features.json.gz is superseded by h200/2026-12-04" in (
      capsys.readouterr().err)


def test_a_changed_file_makes_its_row_stale_and_the_prose_is_kept(copy, capsys):
  path = copy / "docs/verification" / NEWEST_COLD
  data = json.loads(gzip.decompress(path.read_bytes()))
  data["seconds"] = 1.0
  path.write_bytes(gzip.compress(json.dumps(data).encode()))
  assert index.main(["--check"]) == 1
  assert f"stale row for {NEWEST_COLD}" in capsys.readouterr().err
  readme = copy / "docs/verification/README.md"
  header, footer = index._split(readme.read_text())
  assert index.main([]) == 0
  assert index._split(readme.read_text()) == (header, footer)
  assert "1490 cases, 1214 oracle (350.3/min), 0 failed, 1.0 s" in readme.read_text()


def test_a_removed_file_is_named(copy, capsys):
  (copy / "docs/verification/cpu/2026-12-05-f32566c-mutants.txt").unlink()
  assert index.main(["--check"]) == 1
  assert ("row for cpu/2026-12-05-f32566c-mutants.txt, which is not the newest file of its "
          "kind" in capsys.readouterr().err)
