#!/usr/bin/env bash
# Everything the GPU host runs, in one place: GPU tests, benchmarks, the cluster run.
# Usage on the device (from the repository root):
#   bash bench/gpu_run.sh savejit   # FlashInfer modules compiled so far -> $OUT (see below)
#   bash bench/gpu_run.sh run CMD...  # CMD with the same setup (PYTHONPATH, model, $CHUNKSERVE_QWEN3_06B)
#   bash bench/gpu_run.sh tests     # GPU tests (first FlashInfer JIT compiles happen here)
#   bash bench/gpu_run.sh tp        # tensor parallelism on the machine's GPUs (2 or more):
#                                   # bench/tensor_parallel.py and its GPU tests; TP_PARTS
#                                   # picks among "qwen3 llama tests" (all by default: on a
#                                   # fresh machine more than one 600 s call holds, so give
#                                   # one part a call)
#   bash bench/gpu_run.sh tpserve   # tensor parallelism through Ray (needs ray and .whl-http):
#                                   # Llama 3 70B's shapes on 2 ranks through the HTTP app,
#                                   # then a 2-rank worker killed mid-load (cluster_rag --kill)
#   bash bench/gpu_run.sh bench     # benchmarks, tables printed last
#   bash bench/gpu_run.sh cluster   # bench/cluster_rag.py on Ray (needs both ray halves);
#                                   # CLUSTER_ARGS adds arguments, PRESET=qwen3-8b serves that
#                                   # preset's shapes with dummy weights (cluster and http), e.g.
#                                   # WORKERS=2 PRESET=qwen3-8b CLUSTER_ARGS="--reuse exact
#                                   # approximate --docs-per-request 4 --host-kv-gib 0 32 ..."
#                                   # (KILL=0 leaves out the kill test: --cluster-per-run
#                                   # refuses it)
#   bash bench/gpu_run.sh approx    # approximate reuse: speed, its profile, reuse quality
#   bash bench/gpu_run.sh ab        # approximate TTFT, an older tree against this one, in
#                                   # turns (ROUNDS, TRIALS): the older tree unpacked here
#                                   # with `git archive REV workers chunkstore bench cluster
#                                   # modeltools | tar -x -C ab_old` (ignored by git, so the
#                                   # call must carry ab_old)
#   bash bench/gpu_run.sh scattered # attention layouts for scattered queries (issue 12;
#                                   # its custom-mask kernels JIT-compile on first use)
#   bash bench/gpu_run.sh skinny    # the skinny-matmul kernel: its tests, the tile sweep
#                                   # against cuBLAS, batch-1 decode with and without it
#   bash bench/gpu_run.sh http      # bench/http_rag.py: the RAG load through the HTTP app
#                                   # (chunkserve serve, Redis directory, openai client);
#                                   # needs ray and .whl-http (FastAPI, openai, redis-server)
# Wheel bundles that arrived with this call are installed into /tmp/site (see
# .whl/install.sh); ones installed by an earlier call on the same machine stay.
# The cluster and http runs need ray and pydantic (cluster/config.py), FastAPI and the
# rest of .whl-http (bench/prepare_http_wheels.sh builds it); with the working tree each
# call carries at most 64 MiB, so they arrive in three back-to-back calls on one warm
# machine: `run true` with .whl and .whl-ray-a carried, `run true` with .whl-ray-b (and
# .jitcache), then cluster or http with .whl-http.
# Results go to $OUT (or /tmp/chunkserve-results).
set -uo pipefail
out=${OUT:-/tmp/chunkserve-results}
mkdir -p "$out"
# Each bundle is installed once per machine, and on its own: install.sh installs every
# bundle folder present, and a repeated flashinfer install renews its source files'
# times, after which its JIT rebuilds every kernel (two to three minutes per start).
install_once() {
  local bundle=$1 tmp
  [ -f $bundle/install.sh ] && [ ! -f /tmp/site/.installed$bundle ] || return 0
  tmp=$(mktemp -d) && ln -s "$PWD/$bundle" "$tmp/$bundle"
  (cd "$tmp" && source $bundle/install.sh >/dev/null) && touch /tmp/site/.installed$bundle
  rm -rf "$tmp"
}
for bundle in .whl .whl-ray-a .whl-ray-b .whl-http; do install_once $bundle; done
# the redis-server that .whl-http carries (bench/prepare_http_wheels.sh), on its libraries
if [ -x .whl-http/redis/bin/redis-server ] && [ ! -x /tmp/site/.redis/bin/redis-server ]; then
  mkdir -p /tmp/site/.redis/bin && cp -r .whl-http/redis/lib /tmp/site/.redis/ \
    && cp .whl-http/redis/bin/redis-server /tmp/site/.redis/redis-server.bin \
    && printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/site/.redis/lib exec /tmp/site/.redis/redis-server.bin "$@"\n' \
      > /tmp/site/.redis/bin/redis-server && chmod +x /tmp/site/.redis/bin/redis-server
fi
export PYTHONPATH="$PWD:/tmp/site:${PYTHONPATH:-}"
# FlashInfer's JIT compiles each kernel it meets on a fresh machine (minutes). A call
# to `gpu_run.sh savejit` sends the compiled modules back as $out/jit.tar.xz.* (15 MiB parts);
# carried as .jitcache/ (ignored by git), they go where FlashInfer looks for
# ahead-of-time builds (flashinfer/data/aot/<name>/<name>.so) and load without a build.
aot=/tmp/site/flashinfer/data/aot
if ls .jitcache/jit.tar.xz.* >/dev/null 2>&1 && [ -d /tmp/site/flashinfer ] && [ ! -d $aot ]; then
  mkdir -p $aot && cat .jitcache/jit.tar.xz.* | xz -d | tar -C $aot -xf - \
    && echo "gpu_run: $(ls $aot | wc -l) FlashInfer modules from .jitcache"
fi
save_jit() {
  local all=/tmp/jit-all
  rm -rf $all && mkdir -p $all
  [ -d $aot ] && cp -r $aot/. $all/
  for so in "$HOME"/.cache/flashinfer/*/*/cached_ops/*/*.so; do
    [ -f "$so" ] && mkdir -p "$all/$(basename "$(dirname "$so")")" && cp "$so" "$all/$(basename "$(dirname "$so")")/"
  done
  tar -C $all -cf - . | xz -T0 -6 | split -b 15M - "$out/jit.tar.xz."
  echo "gpu_run: saved $(ls $all | wc -l) FlashInfer modules ($(du -ch "$out"/jit.tar.xz.* | tail -1))"
}
model=/tmp/chunkserve-bench/qwen3-0.6b
[ -f $model/config.json ] || python3 -m cluster.ops.cli make-model $model --preset qwen3-0.6b >/dev/null
export CHUNKSERVE_QWEN3_06B=$model CHUNKSERVE_RESULTS_DIR=$out
# The cluster and http modes serve qwen3-0.6b, or PRESET's shapes with random weights
# made in place (e.g. PRESET=qwen3-8b: a miss there costs what it costs users)
shapes_only() {  # a preset's config and tokenizer, no weights (engine.load_format dummy)
  local family=qwen3; [[ $1 == llama* ]] && family=llama
  [ -f /tmp/chunkserve-bench/$1/config.json ] || python3 -m cluster.ops.cli make-model \
    /tmp/chunkserve-bench/$1 --preset $1 --family $family --no-weights >/dev/null
}
cluster_model=(--model $model)
if [ -n "${PRESET:-}" ] && [ "$PRESET" != qwen3-0.6b ]; then
  shapes_only $PRESET && cluster_model=(--model /tmp/chunkserve-bench/$PRESET --load-format dummy)
fi
case "${1:-all}" in
  savejit) save_jit ;;
  run) shift; "$@" ;;  # any command, with the wheels, modules and model in place
  tests) python3 -m pytest tests/gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.txt" ;;
  tp)
    # tensor parallelism over the machine's GPUs: decode at batch 1 and 256 on 1 and 2
    # ranks (Qwen3-8B's shapes, dummy weights), Llama 3 70B's shapes (refused on one GPU,
    # served on two), and the TP GPU tests
    shapes_only qwen3-8b && shapes_only llama3-70b
    parts=" ${TP_PARTS:-qwen3 llama tests} "
    [[ $parts == *" qwen3 "* ]] && python3 bench/tensor_parallel.py \
      --model /tmp/chunkserve-bench/qwen3-8b --sizes 1 2 2>&1 | grep -v Warning \
      | tee "$out/tp_qwen3_8b.txt"
    [[ $parts == *" llama "* ]] && python3 bench/tensor_parallel.py \
      --model /tmp/chunkserve-bench/llama3-70b --sizes 1 2 --batch 64 2>&1 \
      | grep -v Warning | tee "$out/tp_llama3_70b.txt"
    [[ $parts == *" tests "* ]] && python3 -m pytest tests/gpu/test_tensor_parallel_gpu.py \
      -q -p no:cacheprovider 2>&1 | tee "$out/tp_tests.txt" ;;
  tpserve)
    shapes_only llama3-70b
    PATH="/tmp/site/.redis/bin:$PATH" RAY_AUTH_MODE=disabled python3 bench/http_rag.py \
      --model /tmp/chunkserve-bench/llama3-70b --load-format dummy --workers 1 \
      --gpus-per-worker 1 --tensor-parallel-size 2 --replicas 1 --client-processes 1 \
      --requests 48 --warmup 2 --concurrency 8 --docs 16 --doc-tokens 512 --system-tokens 128 \
      --max-tokens 16 --pages 2048 --json "$out/http_tp_70b.json" \
      --serve-log "$out/http_tp_70b_serve.log" 2>&1 | grep -v -e Warning -e '^(' \
      | tee "$out/http_tp_70b.txt"
    RAY_AUTH_MODE=disabled python3 bench/cluster_rag.py --model $model --workers 1 \
      --gpus-per-worker 1 --tensor-parallel-size 2 --policies chunk_aware \
      --requests-per-worker "${KILL_REQUESTS:-1000}" --kill 2>&1 | grep -v -e Warning -e '^(' \
      | tee "$out/tp_kill.txt" ;;
  bench)
    # THROUGHPUT_ARGS, e.g. "--peer-requests 0": skip the slow transformers comparison
    for b in ${BENCHES:-decode_kernel cascade chunk_reuse latency throughput}; do
      extra=""; [ $b = throughput ] && extra="${THROUGHPUT_ARGS:-}"
      python3 bench/$b.py --model $model $extra 2>&1 | grep -v Warning | tee "$out/$b.txt"
    done ;;
  approx)
    python3 bench/approx_speed.py --model $model --json "$out/approx_speed.json" 2>&1 \
      | grep -v Warning | tee "$out/approx_speed.txt"
    python3 bench/approx_profile.py --model $model 2>&1 | grep -v Warning > "$out/approx_profile.txt"
    python3 bench/reuse_quality.py --examples 100 --docs 4 8 16 --hops 1 2 \
      --json "$out/reuse_quality.json" 2>&1 | grep -v " hops " | tee "$out/reuse_quality.txt" ;;
  ab)
    [ -d ab_old/workers ] || { echo "gpu_run: ab needs ab_old/ (carry it)"; exit 2; }
    for round in $(seq "${ROUNDS:-2}"); do
      for tree in ab_old .; do
        echo "== $tree (round $round)"
        (cd $tree && PYTHONPATH="$PWD:/tmp/site" python3 bench/approx_speed.py --model $model \
          --requests 0 --trials "${TRIALS:-9}" 2>&1 | grep -e "^| mode" -e "^| approximate" -e "^| exact")
      done
    done | tee "$out/ab.txt" ;;
  scattered)
    python3 bench/scattered_attention.py 2>&1 | grep -v Warning | tee "$out/scattered_attention.txt" ;;
  skinny)
    python3 -m pytest tests/gpu/test_skinny_kernel.py -q -p no:cacheprovider 2>&1 \
      | tee "$out/skinny_tests.txt"
    python3 bench/skinny_gemm.py --rows 1 4 2>&1 | grep -v Warning | tee "$out/skinny_gemm.txt"
    python3 bench/latency.py --model $model --skinny-ab 2 2>&1 | grep -v Warning \
      | tee "$out/skinny_ab.txt" ;;
  cluster)
    # A private, single-user machine: Ray's token auth is not needed.
    kill=(--kill); [ "${KILL:-1}" = 0 ] && kill=()  # KILL=0: no kill test (--cluster-per-run)
    RAY_AUTH_MODE=disabled python3 bench/cluster_rag.py "${cluster_model[@]}" \
      --workers "${WORKERS:-1,2,4}" --gpus-per-worker "${GPUS_PER_WORKER:-1}" "${kill[@]}" \
      ${CLUSTER_ARGS:-} 2>&1 | grep -v -e Warning -e '^(' | tee "$out/cluster_rag.txt" ;;
  http)
    # Same workload shape and KV cap as cluster's defaults (bench/cluster_rag.py
    # default_pages); redis-server comes from .whl-http.
    PATH="/tmp/site/.redis/bin:$PATH" RAY_AUTH_MODE=disabled python3 bench/http_rag.py \
      "${cluster_model[@]}" --workers "${WORKERS:-4}" --gpus-per-worker 1 --pages 13312 --zipf 0.8 \
      --json "$out/http_rag.json" --serve-log "$out/http_rag_serve.log" ${HTTP_ARGS:-} 2>&1 \
      | grep -v -e Warning -e '^(' | tee "$out/http_rag.txt" ;;
esac
