"""Host time of one FlashInfer prefill plan for a CUDA-graph wrapper, the plan an
approximate admission makes before its selection graph replays (issue 12): one row of
``--tokens`` new tokens over ``--kv`` tokens of paged KV, qwen3-0.6b attention shapes.

    python bench/plan_cost.py [--tokens 4352] [--kv 4384] [--reps 200]

Prints the mean host time of ``wrapper.plan`` (as ``plan_prefill`` calls it, index
arrays in pinned host memory) and of the compiled module's own ``plan`` called with
the same host arrays, then ``wrapper.plan``'s Python functions under cProfile: what
the wrapper spends around the compiled planner.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import flashinfer
import torch

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4352)
    ap.add_argument("--kv", type=int, default=4384)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    device = torch.device("cuda")
    i32 = dict(dtype=torch.int32, device=device)
    pages = -(-args.kv // PAGE)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(128 * 2**20, dtype=torch.uint8, device=device),
        "NHD",
        use_cuda_graph=True,
        qo_indptr_buf=torch.zeros(2, **i32),
        paged_kv_indptr_buf=torch.zeros(2, **i32),
        paged_kv_indices_buf=torch.zeros(pages + 64, **i32),
        paged_kv_last_page_len_buf=torch.zeros(1, **i32),
    )
    pinned = dict(dtype=torch.int32, pin_memory=True)
    qo_indptr = torch.tensor([0, args.tokens], **pinned)
    kv_indptr = torch.tensor([0, pages], **pinned)
    last = torch.tensor([args.kv - (pages - 1) * PAGE], **pinned)
    indices = torch.arange(pages, **i32)

    def plan() -> None:
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            indices,
            last,
            QO_HEADS,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            causal=True,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.bfloat16,
        )

    def timed(call, label: str) -> None:
        for _ in range(10):
            call()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.reps):
            call()
        host = (time.perf_counter() - start) / args.reps
        torch.cuda.synchronize()
        print(f"{label}: {host * 1e6:.1f} us host a call (mean of {args.reps})")

    timed(plan, f"wrapper.plan ({wrapper._backend})")
    kv_lens = torch.tensor([args.kv], dtype=torch.int32)
    module_args = [
        wrapper._float_workspace_buffer,
        wrapper._int_workspace_buffer,
        wrapper._pin_memory_int_workspace_buffer,
        qo_indptr,
        kv_indptr,
        kv_lens,
        wrapper._max_total_num_rows,
        1,
        QO_HEADS,
        KV_HEADS,
        PAGE,
        True,
        HEAD_DIM,
        HEAD_DIM,
        True,
        -1,
    ]
    if wrapper._backend == "fa2":
        module_args += [-1, False, 0]
    timed(lambda: wrapper._cached_module.plan(*module_args), "compiled module's plan alone")
    host = cProfile.Profile()
    host.enable()
    for _ in range(50):
        plan()
    host.disable()
    print("\nwrapper.plan under cProfile, 50 calls:")
    pstats.Stats(host).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
