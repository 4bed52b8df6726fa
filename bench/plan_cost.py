"""Host time of one FlashInfer prefill plan for a CUDA-graph wrapper, the plan an
approximate admission makes before its selection graph replays (issue 12): one row of
``--tokens`` new tokens over ``--kv`` tokens of paged KV, qwen3-0.6b attention shapes.

    python bench/plan_cost.py [--tokens 4352] [--kv 4384] [--reps 200] [--engine [--model DIR]]

Prints the mean host time of ``wrapper.plan`` (through ``plan_prefill``, index arrays
in pinned host memory) and of the compiled planner alone with the same host arrays
(through ``one_row_planner``, as the selection graphs call it), then ``wrapper.plan``'s Python functions under cProfile: what
the wrapper spends around the compiled planner.

``--engine``: first build an engine as ``bench/approx_profile.py`` does and serve one
approximate request (its selection graphs captured), then time, in that process, the
engine's own re-plan of the bucket it used (``one_row_planner``), the same measurements
as above, and both again with Python's garbage collector frozen (``gc.freeze``): the
re-plan took 470 us inside the engine (bench/approx_profile.py) against 165 us alone
(this script without ``--engine``; one H200, c7cf6d5), and this
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
from types import SimpleNamespace

import flashinfer
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.attention.base import AttentionShape  # noqa: E402
from workers.engine.attention.flashinfer_backend import one_row_planner, plan_prefill  # noqa: E402

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
    from workers.engine.graphs.inputs import PLAN_FIELDS
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
        alive, engine_replan = engine_planner(args.model)  # kept alive: its process state
        timed(engine_replan, "the engine's re-plan (one_row_planner)", args.reps)
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
    layout = SimpleNamespace(  # what plan_prefill reads of a BatchLayout
        qo_indptr=torch.tensor([0, args.tokens], **pinned),
        kv_page_indptr=torch.tensor([0, pages], **pinned),
        kv_page_indices=torch.arange(pages, **i32),
        kv_last_page_len=torch.tensor([args.kv - (pages - 1) * PAGE], **pinned),
    )
    shape = AttentionShape(QO_HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16, device)

    def plan() -> None:
        plan_prefill(wrapper, layout, shape)

    timed(plan, "wrapper.plan (plan_prefill)", args.reps)
    print(f"  kernel: {wrapper._backend}")
    kv_len = torch.tensor([args.kv], **pinned)
    replan = one_row_planner(wrapper, shape)  # what the selection graphs call
    assert replan is not None, "this FlashInfer's wrapper is not as one_row_planner reads it"

    def compiled() -> None:
        replan(layout.qo_indptr, layout.kv_page_indptr, kv_len)

    timed(compiled, "compiled module's plan alone", args.reps)
    if args.engine:
        gc.freeze()  # the engine's objects out of the collector's way
        timed(engine_replan, "the engine's re-plan, gc frozen", args.reps)
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
