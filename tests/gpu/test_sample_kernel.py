"""The fused sampling pass: greedy rows equal the argmax, sampled rows follow
softmax(logits / temperature), and the sampler still routes filtering and seeded
rows through the unfused path."""

from __future__ import annotations

import torch

from workers.engine.sampling_params import SamplingParams

VOCAB = 151_936  # Qwen3's: several spans, the last one partial
# finite logits at span edges and inside spans; every other token is -inf
SUPPORT = torch.tensor([0, 5, 16_383, 16_384, 70_001, 151_935])
VALUES = torch.tensor([1.0, 0.2, 2.0, 1.5, -0.5, 0.7])


def support_logits(rows: int) -> torch.Tensor:
    logits = torch.full((rows, VOCAB), float("-inf"), device="cuda")
    logits[:, SUPPORT.cuda()] = VALUES.cuda()
    return logits


def test_greedy_rows_take_the_first_maximum():
    from workers.engine.layers.sample_kernel import gumbel_argmax  # Triton: CUDA hosts

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn((37, VOCAB), generator=gen, device="cuda") * 4
    logits[3, 100] = logits[3, 90_000] = 1e4  # a tie across spans: the first wins
    logits[4, 200] = logits[4, 201] = 1e4  # a tie inside a block
    tokens = gumbel_argmax(logits, torch.zeros(37, device="cuda"), seed=1)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()
    assert tokens[3].item() == 100 and tokens[4].item() == 200
    # a batch of greedy rows only is one argmax in the sampler: the same tokens
    from workers.engine.sampler import sample_on_device

    greedy = [SamplingParams(temperature=0)] * 37
    assert sample_on_device(logits, greedy, [None] * 37).tolist() == tokens.tolist()


def test_the_span_a_program_scans_changes_no_draw():
    """One row (a batch-1 step) is split into short spans to fill the SMs; the
    draws are keyed by the token's index, so they equal those of the longest span."""
    from workers.engine.layers.sample_kernel import MAX_SPAN, gumbel_argmax, span_for

    assert span_for(1, VOCAB, 132) < MAX_SPAN == span_for(256, VOCAB, 132)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for rows in (1, 3):
        logits = torch.randn((rows, VOCAB), generator=gen, device="cuda")
        inv = torch.tensor([0.0, 1.0, 2.0][:rows], device="cuda")
        for seed in range(5):
            short = gumbel_argmax(logits, inv, seed=seed)
            long = gumbel_argmax(logits, inv, seed=seed, span=MAX_SPAN)
            assert short.tolist() == long.tolist()


def test_sampled_rows_follow_the_tempered_distribution():
    from workers.engine.layers.sample_kernel import gumbel_argmax

    rows, draws = 4096, 10
    for temperature in (0.5, 1.0, 2.0):
        counts = torch.zeros(VOCAB, device="cuda")
        inv = torch.full((rows,), 1 / temperature, device="cuda")
        for seed in range(draws):
            tokens = gumbel_argmax(support_logits(rows), inv, seed=seed)
            counts += torch.bincount(tokens, minlength=VOCAB).float()
        inside = counts[SUPPORT.cuda()].cpu()
        assert inside.sum().item() == rows * draws  # nothing outside the support
        seen = inside / (rows * draws)
        want = torch.softmax(VALUES / temperature, dim=0)
        # 40,960 draws: each share's standard error is below 0.0025
        assert (seen - want).abs().sum().item() < 0.02, (temperature, seen, want)


def test_sampler_mixes_fused_and_unfused_rows():
    from workers.engine.sampler import sample_on_device

    logits = support_logits(5)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_k=2),  # unfused: only the two best tokens
        SamplingParams(temperature=1.0, seed=7),  # unfused: its own generator
        SamplingParams(temperature=1.0, top_k=1),  # greedy
    ]
    allowed = set(SUPPORT.tolist())
    seeded = set()
    for _ in range(50):
        draws = []
        for _ in range(2):  # the same seed, a fresh generator: the same draw
            gens = [None, None, None, torch.Generator(device="cuda").manual_seed(7), None]
            draws.append(sample_on_device(logits, params, gens).tolist())
        for tokens in draws:
            assert tokens[0] == tokens[4] == 16_383
            assert tokens[1] in allowed
            assert tokens[2] in {16_383, 16_384}
        assert draws[0][3] == draws[1][3]
        seeded.add(draws[0][3])
    assert len(seeded) == 1


def test_no_batch_size_or_seed_compiles_another_variant():
    """Triton compiles a kernel variant per class of int argument; a per-call seed or
    a per-batch span must not (a compile inside a step costs about half a second)."""
    from workers.engine.layers.sample_kernel import _gumbel_argmax_kernel, gumbel_argmax

    def variants() -> int:
        return sum(len(entry[0]) for entry in _gumbel_argmax_kernel.device_caches.values())

    logits = torch.randn((300, VOCAB), device="cuda")
    inv = torch.ones(300, device="cuda")
    gumbel_argmax(logits[:1], inv[:1], seed=3)
    compiled = variants()
    for rows in (1, 2, 3, 17, 64, 300):
        for seed in (0, 1, 16, 17, 2**30):
            gumbel_argmax(logits[:rows], inv[:rows], seed=seed)
    torch.cuda.synchronize()
    assert variants() == compiled
