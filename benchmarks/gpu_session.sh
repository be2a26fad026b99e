#!/usr/bin/env bash
# One GPU run: compiled smoke check and kernel tests, the D32 replay, the suite's GPU campaign
# (ua_kernels:attention as it dispatches, then the Mosaic backend forced), ua-bench,
# and the Mosaic kernels' time one by one (benchmarks.breakdown).
# Usage (on the GPU machine, from the repository root, package installed):
#   bash benchmarks/gpu_session.sh OUTDIR [campaign_minutes] [bench_set]
set -uo pipefail
out=${1:?outdir}; minutes=${2:-5}; bench=${3:-quick}
export PYTHONUNBUFFERED=1
# Provenance first (commit, versions, GPU, date), as ua-bench writes it into bench.json.
python3 -c "import json; from benchmarks.bench import provenance; print(json.dumps(provenance()))"
timeout 300 python3 -m benchmarks.gpu_smoke 2>&1 | tee $out/smoke.log
timeout 300 python3 -m pytest -q tests/test_mosaic.py 2>&1 | tail -15 | tee $out/test_mosaic.log
# The float32 dk case of docs/DEFECTS.md (D32): within its tolerance since its two fixes.
timeout 300 ua-repro docs/verification/cases/ua_kernels-float32-causal-saturating-zloss-t16384-dk.json \
  2>&1 | tail -12 | tee $out/repro-d32.log
if [ "$minutes" != 0 ]; then
  for impl in ua_kernels:attention ua_kernels.backends:mosaic_attention; do
    name=${impl//[:.]/-}
    timeout $(( ${minutes%.*} * 60 + 240 )) ua-verify --impl $impl --profile gpu --gpus 1 \
      --workers-per-gpu 8 --minutes "$minutes" --failures $out/failures-$name \
      --report $out/campaign-$name.json 2>&1 | tail -60 | tee $out/campaign-$name.log
  done
fi
timeout 400 python3 -m benchmarks.bench --set "$bench" --repeats 7 --json $out/bench.json 2>&1 \
  | grep -v -i warn | tee $out/bench.log
timeout 300 python3 -m benchmarks.breakdown --json $out/breakdown.json 2>&1 | grep -v -i warn \
  | tee $out/breakdown.log
