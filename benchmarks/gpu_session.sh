#!/usr/bin/env bash
# One device call: compiled smoke check, the suite's GPU campaign, and ua-bench.
# Usage (on the GPU machine, from the repository root, package installed):
#   bash benchmarks/gpu_session.sh OUTDIR [campaign_minutes] [bench_set]
set -uo pipefail
out=${1:?outdir}; minutes=${2:-5}; bench=${3:-quick}
export PYTHONUNBUFFERED=1
# Provenance first (commit, versions, GPU, date), as ua-bench writes it into bench.json.
python3 -c "import json; from benchmarks.bench import provenance; print(json.dumps(provenance()))"
timeout 300 python3 -m benchmarks.gpu_smoke 2>&1 | tee $out/smoke.log
if [ "$minutes" != 0 ]; then
  timeout $(( ${minutes%.*} * 60 + 240 )) ua-verify --profile gpu --gpus 1 --minutes "$minutes" \
    --failures $out/failures --report $out/campaign.json 2>&1 | tail -60 | tee $out/campaign.log
fi
timeout 400 python3 -m benchmarks.bench --set "$bench" --repeats 7 --json $out/bench.json 2>&1 \
  | grep -v -i warn | tee $out/bench.log
