#!/usr/bin/env bash
# The .whl-http bundle for the GPU host (no network there): what the cluster and
# HTTP runs of bench/gpu_run.sh need beyond torch, flashinfer (.whl) and ray
# (.whl-ray-a, .whl-ray-b): pydantic and FastAPI for cluster/, the openai client and
# redis for bench/http_rag.py. Versions follow this machine's installed ones, so the
# GPU host runs what the CPU suite tested. Run from the repository root, after
# ../shared/gpu-host/prepare-wheels.sh (whose install.sh it copies).
set -euo pipefail
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
pinned() { python3 -m pip show "$1" 2>/dev/null | awk -v n="$1" '/^Version:/ {print n "==" $2}'; }
names=(pydantic pydantic_core annotated_types typing_inspection fastapi starlette uvicorn opentelemetry-api
       openai httpx2 httpcore2 truststore jiter sniffio redis)
specs=()
for n in "${names[@]}"; do
  s=$(pinned "$n"); [ -n "$s" ] || { echo "prepare_http_wheels: $n is not installed here" >&2; exit 1; }
  specs+=("$s")
done
mkdir -p .whl-http && rm -f .whl-http/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl-http "${specs[@]}"
cp .whl/install.sh .whl-http/
du -sh .whl-http
# bench/http_rag.py also needs a redis-server binary there (none ships as a wheel for
# Python 3.12): copy one with the libraries it links beside glibc into
# /tmp/site/.redis/bin, where gpu_run.sh http looks.
