"""What the compiler makes of the Triton kernels, checked on any host: their code for a
Hopper GPU is built here (PTX, no device needed) and inspected. Speed needs the GPU;
these catch the code shapes that decide it (a span passed to the sampler as a plain
runtime argument makes its loads of the logits 4 bytes wide instead of 16)."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton", reason="Triton has no wheel for this platform")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("the interpreter compiles nothing", allow_module_level=True)


def hopper_ptx(
    fn, signature: dict[str, str], constexprs: dict[str, int], aligned: list[str]
) -> str:
    """PTX of ``fn`` for sm_90, the ``aligned`` arguments (pointers, ints) declared
    divisible by 16 as Triton specializes them at a launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = [p.name for p in fn.params]
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def test_the_sampler_reads_the_logits_in_vector_loads():
    from workers.engine.layers.sample_kernel import BLOCK, _gumbel_argmax_kernel

    signature = {
        "logits_ptr": "*fp32",
        "stride": "i32",
        "vocab": "i32",
        "inv_temp_ptr": "*fp32",
        "seed": "i32",
        "best_val_ptr": "*fp32",
        "best_idx_ptr": "*i32",
        "spans": "i32",
        "blocks": "i32",
        "BLOCK": "constexpr",
    }
    # as a launch over Qwen3's vocabulary specializes them (151,936 = 16 x 9,496)
    aligned = ["logits_ptr", "stride", "vocab", "inv_temp_ptr", "best_val_ptr", "best_idx_ptr"]
    ptx = hopper_ptx(_gumbel_argmax_kernel, signature, {"BLOCK": BLOCK}, aligned)
    assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", ptx), "the logits are read 4 bytes a load"
