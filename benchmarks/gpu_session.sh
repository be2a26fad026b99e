#!/usr/bin/env bash
# One device call: compiled smoke check, the suite's gpu profile, and ua-bench.
# Usage (on the GPU machine): bash benchmarks/gpu_session.sh OUTDIR [suite_seconds] [bench_set]
set -uo pipefail
out=${1:?outdir}; suite_s=${2:-300}; bench=${3:-quick}
export PYTHONUNBUFFERED=1 UA_FAILURE_DIR=$out/failures
# Provenance first (commit, versions, GPU, date), as ua-bench writes it into bench.json.
python3 -c "import json; from benchmarks.bench import provenance; print(json.dumps(provenance()))"
timeout 300 python3 -m benchmarks.gpu_smoke 2>&1 | tee $out/smoke.log
if [ "$suite_s" -gt 0 ]; then
  UA_REPORT_DIR=$out timeout "$suite_s" python3 -m pytest tests/test_properties.py \
    --hypothesis-profile=gpu -q -p no:cacheprovider -W ignore::DeprecationWarning 2>&1 \
    | tail -60 | tee $out/gpu_suite.log
fi
timeout 400 python3 -m benchmarks.bench --set "$bench" --repeats 7 --json $out/bench.json 2>&1 \
  | grep -v -i warn | tee $out/bench.log
