#!/usr/bin/env bash
# Everything the GPU host runs, in one place: GPU tests, then every benchmark.
# Usage on the device (from the repository root):
#   bash bench/gpu_run.sh tests   # GPU tests (first FlashInfer JIT compiles happen here)
#   bash bench/gpu_run.sh bench   # benchmarks, tables printed last
# Results go to $OUT (or /tmp/chunkserve-results).
set -uo pipefail
out=${OUT:-/tmp/chunkserve-results}
mkdir -p "$out"
source .whl/install.sh >/dev/null
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
model=/tmp/chunkserve-bench/qwen3-0.6b
[ -f $model/config.json ] || python3 -m cluster.cli make-model $model --preset qwen3-0.6b >/dev/null
export CHUNKSERVE_QWEN3_06B=$model CHUNKSERVE_RESULTS_DIR=$out
case "${1:-all}" in
  tests) python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" ;;
  bench)
    for b in ${BENCHES:-decode_kernel cascade chunk_reuse latency throughput}; do
      python3 bench/$b.py --model $model 2>&1 | grep -v Warning | tee "$out/$b.txt"
    done ;;
esac
