#!/usr/bin/env bash
# The .whl-http bundle for the GPU host (no network there): what the cluster and
# HTTP runs of bench/gpu_run.sh need beyond torch, flashinfer (.whl) and ray
# (.whl-ray-a, .whl-ray-b): pydantic and FastAPI for cluster/, the openai client and
# redis for bench/http_rag.py, grpcio-reflection for Ray Serve, and uvicorn's standard
# extras (httptools, uvloop: what `pip install ray[serve]` brings; h11 alone parses
# HTTP in Python, several times slower), and xgrammar for structured output (its
# apache-tvm-ffi comes with .whl). Versions follow this machine's installed ones, so the
# GPU host runs what the CPU suite tested. Run from the repository root, after
# ../shared/gpu-host/prepare-wheels.sh (whose install.sh it copies).
set -euo pipefail
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform any)
pinned() { python3 -m pip show "$1" 2>/dev/null | awk -v n="$1" '/^Version:/ {print n "==" $2}'; }
names=(pydantic pydantic_core annotated_types typing_inspection fastapi starlette uvicorn opentelemetry-api
       openai httpx2 httpcore2 truststore jiter sniffio redis httptools uvloop h11 click xgrammar)
specs=()
for n in "${names[@]}"; do
  s=$(pinned "$n"); [ -n "$s" ] || { echo "prepare_http_wheels: $n is not installed here" >&2; exit 1; }
  specs+=("$s")
done
# grpcio-reflection's generated code needs the grpcio beside it: the GPU host's (1.84.0
# in its image), not this machine's
specs+=("grpcio-reflection==${HOST_GRPCIO:-1.84.0}")
mkdir -p .whl-http && rm -f .whl-http/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl-http "${specs[@]}"
cp .whl/install.sh .whl-http/
# bench/http_rag.py also needs a redis-server there, and none ships as a wheel for
# Python 3.12: this machine's binary travels with the libraries it links beyond glibc
# (.whl-http/redis/{bin,lib}); gpu_run.sh puts it in /tmp/site/.redis/bin.
server=$(command -v redis-server) || { echo "prepare_http_wheels: no redis-server here" >&2; exit 1; }
rm -rf .whl-http/redis && mkdir -p .whl-http/redis/bin .whl-http/redis/lib
cp "$server" .whl-http/redis/bin/
ldd "$server" | awk '/=> \// {print $3}' | grep -v -E '/(libc|libm|libpthread|libdl|librt|ld-linux[^/]*)\.so' \
  | xargs -I{} cp -L {} .whl-http/redis/lib/
du -sh .whl-http
