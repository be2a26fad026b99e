"""benchmarks.bench's case selection (--cases): a run cut short is finished by naming
the cases it did not reach, so the names must select exactly those; and the decode
set's rows, timed in the interpreter on tiny shapes (the times say nothing there)."""

import pytest

from benchmarks import bench


def test_cases_select_the_configurations_whose_name_holds_a_part():
  every = bench.selected_configs("targets", "bfloat16")
  assert len(every) == 18
  long = bench.selected_configs("targets", "bfloat16", "T16384")
  assert [config[1] for _, config in long] == [16384] * 6
  picked = bench.selected_configs("targets", "bfloat16", "T16384 H16/16 D64 causal, D256 causal")
  assert [label for label, _ in picked] == [
      "B4 T4096 H16/16 D256 causal", "B16 T1024 H16/16 D256 causal",
      "B1 T16384 H16/16 D64 causal", "B1 T16384 H16/16 D256 causal"]


def test_labels_are_the_result_rows_case_names():
  assert bench.case_label("bfloat16", 4, 4096, 16, 16, 128, True, 0, 0.0, 0) == \
      "B4 T4096 H16/16 D128 causal"
  assert bench.case_label("float16", 1, 16384, 16, 4, 64, False, 512, 30.0, 1024) == \
      "B1 T16384 H16/4 D64 f16 win512 tanh30 docs1024"


def test_cases_that_name_nothing_are_refused(capsys):
  with pytest.raises(SystemExit):
    bench.main(["--set", "targets", "--cases", "T999"])
  assert "--cases 'T999' names none" in capsys.readouterr().err


def test_ua_bench_launches_the_checkouts_harness_and_refuses_elsewhere(tmp_path, monkeypatch,
                                                                     capsys):
  """benchmarks/ is not installed; ua-bench runs it from a source checkout and
  says so anywhere else."""
  import pathlib
  import sys

  from ua_kernels import checkout_tools
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit, match="source checkout"):
    checkout_tools.bench_main()
  monkeypatch.chdir(pathlib.Path(__file__).resolve().parent.parent)
  monkeypatch.setattr(sys, "argv", ["ua-bench", "--help"])
  with pytest.raises(SystemExit) as exit_:
    checkout_tools.bench_main()
  assert exit_.value.code == 0 and "--set" in capsys.readouterr().out


def test_the_decode_set_writes_a_row_per_implementation_and_shape(tmp_path, monkeypatch, capsys):
  """--set decode (in the interpreter, two tiny shapes): every ua_kernels
  variant of every shape has a time and its K/V bandwidth; the sinks rows are
  timed with and without sinks; the file holds its provenance."""
  import json
  from benchmarks import decode
  monkeypatch.setattr(decode, "DECODE_SHAPES", [(1, 1, 256, 4, 2, 32)])
  monkeypatch.setattr(decode, "SINK_SHAPES", [(1, 1, 128, 2, 32, False)])
  monkeypatch.setattr(decode, "OTHER_KEYS_SHAPES", [(1, 8, 40, 2, 1, 32, True)])
  out = tmp_path / "decode.json"
  bench.main(["--set", "decode", "--repeats", "1", "--no-peers", "--json", str(out)])
  result = json.loads(out.read_text())
  assert result["commit"] and result["command"]
  decode_rows = [r for r in result["rows"] if r["case"].startswith("decode")]
  assert {r["impl"] for r in decode_rows} == {
      "ua_kernels", "ua_kernels[kv_splits=1]", "ua_kernels[pack_gqa=False]",
      "ua_kernels[neither]"}
  assert all(r["fwd_ms"] > 0 and r["kv_gbps"] > 0 for r in decode_rows)
  sinks = [r for r in result["rows"] if r["case"].startswith("sinks")]
  assert len(sinks) == 4 and all(r["fwd_bwd_ms"] > 0 for r in sinks)
  # The Mosaic forward cannot run in the interpreter: its row holds the error.
  keys = {r["impl"]: r for r in result["rows"] if r["case"].startswith("keys")}
  assert keys["ua_kernels[triton]"]["fwd_bwd_ms"] > 0 and "error" in keys["ua_kernels[mosaic]"]
  assert "ratio sinks" in capsys.readouterr().out
