#!/usr/bin/env bash
# Run `chunkserve batch` as a Ray job on a running Ray cluster.
#
#   deploy/submit_batch.sh [CONFIG [INPUT [OUTPUT]]] [--set dotted.key=value ...]
#   deploy/submit_batch.sh                                   # local.yaml, the example requests
#   RAY_ADDRESS=http://HEAD:8265 deploy/submit_batch.sh configs/redis.yaml my.jsonl /data/out.jsonl
#
# The repository root is uploaded as the job's working directory, so CONFIG and INPUT
# are paths inside it. OUTPUT is written by the job's driver, on the head node: give
# an absolute path there. Submitting again with the same OUTPUT resumes the batch
# (ids already written are skipped). RAY_ADDRESS picks the cluster (default: the
# dashboard at 127.0.0.1:8265).
set -euo pipefail

cd "$(dirname "$0")/.."

config=${1:-configs/local.yaml}
input=${2:-configs/examples/rag_requests.jsonl}
output=${3:-/tmp/chunkserve-batch-output.jsonl}
shift $(($# < 3 ? $# : 3))

exec ray job submit --working-dir . -- \
    chunkserve batch --config "$config" --input "$input" --output "$output" "$@"
