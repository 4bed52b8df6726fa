"""Host time of one FlashInfer prefill plan for a CUDA-graph wrapper, the plan an
approximate admission makes before its selection graph replays (issue 12): one row of
``--tokens`` new tokens over ``--kv`` tokens of paged KV, qwen3-0.6b attention shapes.

    python bench/plan_cost.py [--tokens 4352] [--kv 4384] [--reps 200] [--engine [--model DIR]]

Prints the mean host time of ``wrapper.plan`` (as ``plan_prefill`` calls it, index
arrays in pinned host memory) and of the compiled module's own ``plan`` called with
the same host arrays, then ``wrapper.plan``'s Python functions under cProfile: what
the wrapper spends around the compiled planner.

``--engine``: first build an engine as ``bench/approx_profile.py`` does and serve one
approximate request (its selection graphs captured), then time, in that process, the
engine's own re-plan of the bucket it used (``one_row_planner``), the same measurements
as above, and both again with Python's garbage collector frozen (``gc.freeze``): the
re-plan took 470 us inside the engine against 165 us alone (session 34), and this
tells the process's state from the call itself.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from pathlib import Path

import flashinfer
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QO_HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16


def timed(call, label: str, reps: int) -> None:
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        call()
    host = (time.perf_counter() - start) / reps
    torch.cuda.synchronize()
    print(f"{label}: {host * 1e6:.1f} us host a call (mean of {reps})")


def engine_planner(model_dir: str | None):
    """An engine after one approximate request, and its re-plan of the bucket used."""
    from bench.approx_speed import FIRST_TOKEN, QUESTION, SYSTEM, held_documents, layout
    from workers.engine.graph_inputs import PLAN_FIELDS
    from workers.engine.reuse_info import ReuseRequest

    runner, docs, draw = held_documents(model_dir)
    prompt, spans = layout(draw(SYSTEM), docs[::-1], draw(QUESTION))
    runner.submit(prompt, spans, ReuseRequest("approximate"), FIRST_TOKEN)
    runner.drain()
    selection = runner.engine.runner.selection_graphs
    (g,) = selection.graphs.values()
    host = selection.plan_staged
    views = [host[PLAN_FIELDS[name]] for name in ("qo_indptr", "kv_page_indptr", "kv_len")]
    return runner, lambda: g.plan(*views)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4352)
    ap.add_argument("--kv", type=int, default=4384)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--engine", action="store_true", help="also inside a built engine")
    ap.add_argument("--model", help="with --engine: the checkpoint (default: qwen3-0.6b)")
    args = ap.parse_args()
    if args.engine:
        alive, replan = engine_planner(args.model)  # the engine stays alive: its process state
        timed(replan, "the engine's re-plan (one_row_planner)", args.reps)
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

    timed(plan, f"wrapper.plan ({wrapper._backend})", args.reps)
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
    compiled = lambda: wrapper._cached_module.plan(*module_args)  # noqa: E731
    timed(compiled, "compiled module's plan alone", args.reps)
    if args.engine:
        gc.freeze()  # the engine's objects out of the collector's way
        timed(replan, "the engine's re-plan, gc frozen", args.reps)
        timed(compiled, "compiled module's plan alone, gc frozen", args.reps)
        gc.unfreeze()
    host = cProfile.Profile()
    host.enable()
    for _ in range(50):
        plan()
    host.disable()
    print("\nwrapper.plan under cProfile, 50 calls:")
    pstats.Stats(host).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
