#!/usr/bin/env bash
# Run `chunkserve batch` as a Ray job on a running Ray cluster.
#
#   deploy/submit_batch.sh [CONFIG [INPUT [OUTPUT]]] [--set dotted.key=value ...] [--retry-errors]
#   deploy/submit_batch.sh                                   # local.yaml, the example requests
#   RAY_ADDRESS=http://HEAD:8265 deploy/submit_batch.sh configs/redis.yaml my.jsonl /data/out.jsonl
#
# Options may come anywhere among the positional arguments. The repository root is
# uploaded as the job's working directory, so CONFIG and INPUT are paths inside it.
# OUTPUT is written by the job's driver, on the head node: give an absolute path there.
# Submitting again with the same OUTPUT resumes the batch (ids already written are
# skipped). RAY_ADDRESS picks the cluster (default: the dashboard at 127.0.0.1:8265).
set -euo pipefail

cd "$(dirname "$0")/.."

positional=()
options=()
while (($#)); do
  case "$1" in
    --set)
      (($# >= 2)) || { echo "submit_batch.sh: --set needs dotted.key=value" >&2; exit 2; }
      options+=("$1" "$2")
      shift 2
      ;;
    --set=* | --retry-errors)
      options+=("$1")
      shift
      ;;
    -*)
      echo "submit_batch.sh: unknown option $1 (takes --set dotted.key=value and --retry-errors)" >&2
      exit 2
      ;;
    *)
      positional+=("$1")
      shift
      ;;
  esac
done
if ((${#positional[@]} > 3)); then
  echo "submit_batch.sh: at most CONFIG INPUT OUTPUT, got: ${positional[*]}" >&2
  exit 2
fi

config=${positional[0]:-configs/local.yaml}
input=${positional[1]:-configs/examples/rag_requests.jsonl}
output=${positional[2]:-/tmp/chunkserve-batch-output.jsonl}

exec ray job submit --working-dir . -- \
    chunkserve batch --config "$config" --input "$input" --output "$output" ${options[@]+"${options[@]}"}
