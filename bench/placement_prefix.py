"""Does computing a position-free document entry *after a fixed shared prefix* make
its placed KV closer to the KV the document gets in context?

    python bench/placement_prefix.py --examples 60 --docs 8 --seed 0 \
        --json /tmp/placement_prefix.json

A standalone experiment (transformers weights, float32, CPU, no engine): the
question is whether the distortion of naive placement (docs/design.md, "Approximate
reuse") comes mainly from the entry being computed from position 0 (its first
token becomes the attention sink, and its tokens never see the conversation's
opening). Each variant builds the prompt's KV as follows:

- ``full``: every token computed in context (the reference).
- ``prefix=NAME``: every document chunk's KV is computed alone after the fixed
  token prefix ``NAME`` (``none``: no prefix, i.e. the engine's current entries),
  the prefix's KV dropped, and the document's keys rotated from position
  ``len(prefix)`` to the chunk's offset in the prompt. Every other token (system
  turn, user header, question, generation prompt) is computed in context over the
  placed KV, and with ``k`` > 0 so are the first ``k`` tokens of every document
  (the engine's first-token repair: queries at those positions attend causally, by
  position, to the placed KV and to every token computed in the same pass).

Chunking is the engine's (``chunk_conversation``): system turn, user header
``<|im_start|>user\\n``, one chunk per document, question, generation prompt; only
document chunks are placed (as ``bench/reuse_quality.py`` passes them).

Per (variant, hops): greedy exact match of the first answer token, mean
KL(full || variant) of the first answer token's distribution, and the share of
placed tokens recomputed. Gold documents stay where the generator drew them.

The forward pass is written out layer by layer from the checkpoint's own modules
(Qwen3: q/k norm before RoPE, GQA, no bias, no sliding window); it is checked
against ``Qwen3ForCausalLM`` logits, and the key rotation against computing a
document directly at its offset, before any measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkstore.chunking import chunk_conversation  # noqa: E402
from modeltools import docqa_data  # noqa: E402
from modeltools.docqa_train import answer_space_of, heldout_set, prompt_ids  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "modeltools" / "docqa_model"
HEADER = "<|im_start|>user\n"
FIXED_SYSTEM = docqa_data.SYSTEM_PROMPTS[0]  # the fixed one; examples using it are flagged
NOVEL_SYSTEM = "You are a helpful assistant."  # never seen in training
# A dummy document from the training generator (not any held-out example's).
DUMMY_DOC = docqa_data.generate(3, 1, 2, "train", hops=1)[0].documents[0]


def system_turn(text: str) -> str:
    return f"<|im_start|>system\n{text}<|im_end|>\n"


# name -> prefix text (None: per-example, see ``prefix_text``)
PREFIXES: dict[str, str | None] = {
    "none": "",
    "im_start": "<|im_start|>",
    "im_start_system": "<|im_start|>system\n",
    "user_header": HEADER,
    "sys_empty": system_turn("") + HEADER,
    "sys_fixed_no_header": system_turn(FIXED_SYSTEM),
    "sys_fixed": system_turn(FIXED_SYSTEM) + HEADER,
    "sys_novel": system_turn(NOVEL_SYSTEM) + HEADER,
    "sys_fixed+doc": system_turn(FIXED_SYSTEM) + HEADER + DUMMY_DOC,
    # Diagnostic only (not a fixed prefix an engine could share): the example's own
    # system turn and user header, i.e. what every document sees in context minus the
    # documents before it.
    "own_sys (oracle)": None,
}


def prefix_text(name: str, example) -> str:
    text = PREFIXES[name]
    return system_turn(example.system) + HEADER if text is None else text


# -- model -------------------------------------------------------------------------


class Manual:
    """Qwen3 forward over an arbitrary set of *computed* tokens, the others' K/V
    given (already rotated to their positions). Attention is causal by position."""

    def __init__(self, model: Qwen3ForCausalLM) -> None:
        cfg = model.config
        self.model = model
        self.layers = model.model.layers
        self.head_dim = cfg.head_dim
        self.n_q = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", None))
        rope_type = rope.get("rope_type", "default")
        if (
            rope_type != "default"
            or getattr(cfg, "sliding_window", None)
            and cfg.use_sliding_window
        ):
            raise ValueError("plain RoPE and full attention only")
        self.theta = float(theta)
        # As transformers computes it: inv_freq[i] = theta^(-2i/d), float32.
        self.inv_freq = 1.0 / (
            self.theta
            ** (torch.arange(0, self.head_dim, 2, dtype=torch.int64).float() / self.head_dim)
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # pairs (i, i + d/2) share a frequency
        return emb.cos(), emb.sin()

    @staticmethod
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def rotate(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Keys ``k`` [heads, n, d] rotated by ``delta`` positions."""
        if delta == 0:
            return k
        # Angle in float64 then cast: composes with the float32 angles of HF's RoPE
        # to within rounding.
        angle = delta * (
            1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2).double() / self.head_dim))
        )
        emb = torch.cat((angle, angle))
        cos, sin = emb.cos().float(), emb.sin().float()
        return k * cos + self.rotate_half(k) * sin

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,  # [N] token ids
        positions: torch.Tensor,  # [N] positions (increasing)
        compute: torch.Tensor,  # [n] indices of computed tokens (sorted)
        fixed: list[tuple[torch.Tensor, torch.Tensor]] | None = None,  # per layer K, V [kv, N, d]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Log-probabilities at the last computed token, and every layer's K/V."""
        n_total = ids.shape[0]
        if fixed is None and compute.numel() != n_total:
            raise ValueError("tokens not computed need given K/V")
        h = self.model.model.embed_tokens(ids[compute])  # [n, D]
        pos_c = positions[compute]
        cos, sin = self.cos_sin(pos_c)
        mask = positions[None, :] <= pos_c[:, None]  # [n, N]
        group = self.n_q // self.n_kv
        out_kv = []
        for index, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            n = x.shape[0]
            q = attn.q_norm(attn.q_proj(x).view(n, self.n_q, self.head_dim)).transpose(0, 1)
            k = attn.k_norm(attn.k_proj(x).view(n, self.n_kv, self.head_dim)).transpose(0, 1)
            v = attn.v_proj(x).view(n, self.n_kv, self.head_dim).transpose(0, 1)
            q = q * cos + self.rotate_half(q) * sin
            k = k * cos + self.rotate_half(k) * sin
            if fixed is None:
                K, V = k, v
            else:
                K, V = fixed[index][0].clone(), fixed[index][1].clone()
                K[:, compute] = k
                V[:, compute] = v
            out_kv.append((K, V))
            Kq = K.repeat_interleave(group, dim=0)
            Vq = V.repeat_interleave(group, dim=0)
            scores = (q @ Kq.transpose(1, 2)) * self.scaling  # [Hq, n, N]
            scores = scores.masked_fill(~mask, float("-inf"))
            a = torch.softmax(scores, dim=-1) @ Vq  # [Hq, n, d]
            a = a.transpose(0, 1).reshape(n, self.n_q * self.head_dim)
            h = h + attn.o_proj(a)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        last = self.model.model.norm(h[-1:])
        logits = self.model.lm_head(last)[0]
        assert n_total == 0 or compute[-1] == n_total - 1, "last token must be computed"
        return torch.log_softmax(logits.double(), -1), out_kv


# -- prompts -----------------------------------------------------------------------


@dataclass
class Prompt:
    example: docqa_data.DocQAExample
    ids: list[int]
    doc_spans: list[tuple[int, int]]
    target: int  # first answer token


def build_prompt(tokenizer, example, answer_space: bool) -> Prompt:
    chunks = chunk_conversation(tokenizer, example.messages)
    if len(chunks) != example.num_docs + 4:
        raise ValueError("unexpected chunking")
    ids, spans = [], []
    for index, chunk in enumerate(chunks):
        if 2 <= index < 2 + example.num_docs:
            spans.append((len(ids), len(ids) + len(chunk.token_ids)))
        ids += chunk.token_ids
    if ids != prompt_ids(tokenizer, example):
        raise ValueError("engine chunking and prompt_ids disagree")
    reply = docqa_data.reply_text(example.answer, answer_space)
    target = tokenizer.encode(reply, add_special_tokens=False)[0]
    return Prompt(example, ids, spans, target)


# -- variants ----------------------------------------------------------------------


class Entries:
    """Position-free entries: a document's K/V computed after a prefix, prefix KV
    dropped, memoized by (prefix tokens, document tokens)."""

    def __init__(self, manual: Manual) -> None:
        self.manual = manual
        self.memo: dict[tuple[tuple[int, ...], tuple[int, ...]], list] = {}

    def get(self, prefix: list[int], doc: list[int]):
        key = (tuple(prefix), tuple(doc))
        if key not in self.memo:
            ids = torch.tensor(prefix + doc)
            n = len(ids)
            _, kv = self.manual.forward(ids, torch.arange(n), torch.arange(n))
            self.memo[key] = [
                (K[:, len(prefix) :].clone(), V[:, len(prefix) :].clone()) for K, V in kv
            ]
        return self.memo[key]


def run_variant(manual: Manual, entries: Entries, prompt: Prompt, prefix: list[int], k: int):
    n = len(prompt.ids)
    ids = torch.tensor(prompt.ids)
    positions = torch.arange(n)
    layers = len(manual.layers)
    fixed = [
        (torch.zeros(manual.n_kv, n, manual.head_dim), torch.zeros(manual.n_kv, n, manual.head_dim))
        for _ in range(layers)
    ]
    computed = torch.ones(n, dtype=torch.bool)
    recomputed = 0
    for start, end in prompt.doc_spans:
        entry = entries.get(prefix, prompt.ids[start:end])
        delta = start - len(prefix)
        for index, (K, V) in enumerate(entry):
            fixed[index][0][:, start:end] = manual.rotate(K, delta)
            fixed[index][1][:, start:end] = V
        kept_from = start + min(k, end - start)
        computed[kept_from:end] = False
        recomputed += kept_from - start
    logp, _ = manual.forward(ids, positions, torch.nonzero(computed)[:, 0], fixed)
    return logp, recomputed


# -- checks ------------------------------------------------------------------------


@torch.no_grad()
def self_check(model, manual: Manual, prompt: Prompt) -> dict[str, float]:
    ids = torch.tensor(prompt.ids)
    n = len(ids)
    ref = torch.log_softmax(model(input_ids=ids[None]).logits[0, -1].double(), -1)
    mine, _ = manual.forward(ids, torch.arange(n), torch.arange(n))
    logits_err = float((ref - mine).abs().max())
    # Rotation: a document alone at 0, rotated to p, vs the document alone at p..p+n-1.
    start, end = prompt.doc_spans[-1]
    doc = ids[start:end]
    m = len(doc)
    _, kv0 = manual.forward(doc, torch.arange(m), torch.arange(m))
    _, kvp = manual.forward(doc, torch.arange(start, start + m), torch.arange(m))
    k_err = max(
        float((manual.rotate(K0, start) - Kp).abs().max())
        for (K0, _), (Kp, _) in zip(kv0, kvp, strict=True)
    )
    k_scale = max(float(Kp.abs().max()) for Kp, _ in kvp)
    v_err = max(float((V0 - Vp).abs().max()) for (_, V0), (_, Vp) in zip(kv0, kvp, strict=True))
    # Placement with every document token recomputed reproduces full prefill.
    allk, _ = run_variant(manual, Entries(manual), prompt, [], 10**6)
    full_err = float((ref - allk).abs().max())
    # And HF's own rotary embedding agrees with ours at position ``start``.
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1), torch.tensor([[start]]))
    mc, ms = manual.cos_sin(torch.tensor([start]))
    rope_err = max(float((cos[0] - mc).abs().max()), float((sin[0] - ms).abs().max()))
    return {
        "max |logp manual - HF|": logits_err,
        "max |K rotated(0->p) - K at p|": k_err,
        "max |K| (scale)": k_scale,
        "max |V at 0 - V at p|": v_err,
        "max |logp all-recomputed - HF|": full_err,
        "max |cos/sin manual - HF rotary|": rope_err,
        "p": start,
    }


# -- main --------------------------------------------------------------------------


def kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    return float((ref.exp() * (ref - other)).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--examples", type=int, default=60, help="per number of hops")
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--prefixes", nargs="+", default=list(PREFIXES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    started = time.perf_counter()
    model = Qwen3ForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    manual = Manual(model)
    space = answer_space_of(args.model)
    examples = heldout_set(args.seed, 2 * args.examples, args.docs)
    prompts = [build_prompt(tokenizer, ex, space) for ex in examples]

    check = self_check(model, manual, prompts[0])
    print("self-check:", json.dumps(check))
    if check["max |logp manual - HF|"] > 1e-3 or check["max |logp all-recomputed - HF|"] > 1e-3:
        raise SystemExit("manual forward disagrees with transformers")
    if check["max |K rotated(0->p) - K at p|"] > 1e-4 or check["max |V at 0 - V at p|"] > 1e-4:
        raise SystemExit("key rotation disagrees with RoPE at the offset")

    prefix_ids = {}
    for name in args.prefixes:
        if PREFIXES[name] is not None:
            prefix_ids[name] = tokenizer.encode(PREFIXES[name], add_special_tokens=False)
            print(f"prefix {name!r}: {len(prefix_ids[name])} tokens: {PREFIXES[name]!r}")

    entries = Entries(manual)
    rows: dict[tuple[str, int, int], list] = {}
    full_ok = {}
    refs = []
    for i, prompt in enumerate(prompts):
        ids = torch.tensor(prompt.ids)
        n = len(ids)
        ref, _ = manual.forward(ids, torch.arange(n), torch.arange(n))
        refs.append(ref)
        hops = prompt.example.hops
        full_ok[i] = int(ref.argmax()) == prompt.target
        rows.setdefault(("full", 0, hops), []).append((full_ok[i], 0.0, 0, 0, i))
        placed = sum(e - s for s, e in prompt.doc_spans)
        for name in args.prefixes:
            prefix = prefix_ids.get(name)
            if prefix is None:
                prefix = tokenizer.encode(
                    prefix_text(name, prompt.example), add_special_tokens=False
                )
            for k in args.k:
                logp, rec = run_variant(manual, entries, prompt, prefix, k)
                ok = int(logp.argmax()) == prompt.target
                rows.setdefault((name, k, hops), []).append((ok, kl(ref, logp), rec, placed, i))
        if i == 1:
            per = (time.perf_counter() - started) / 2
            print(f"~{per:.2f}s per example (incl. load), {len(prompts)} examples")
    elapsed = time.perf_counter() - started

    def summarize(items):
        acc = sum(o for o, *_ in items) / len(items)
        kls = [x for _, x, *_ in items]
        share = sum(r for _, _, r, _, _ in items) / max(1, sum(p for *_, p, _ in items))
        return acc, sum(kls) / len(kls), sorted(kls)[len(kls) // 2], share

    fixed_sys_idx = {i for i, p in enumerate(prompts) if p.example.system == FIXED_SYSTEM}
    table = []
    header = (
        f"{'variant':<22}{'k':>3}{'hops':>5}{'n':>4}{'acc':>8}{'meanKL':>9}{'medKL':>9}"
        f"{'recomp':>8}{'acc(sys!=P)':>13}"
    )
    print(header)
    print("-" * len(header))
    for (name, k, hops), items in rows.items():
        acc, mkl, medkl, share = summarize(items)
        other = [it for it in items if it[-1] not in fixed_sys_idx]
        acc_other = sum(o for o, *_ in other) / len(other) if other else math.nan
        row = {
            "variant": name,
            "k": k,
            "hops": hops,
            "n": len(items),
            "accuracy": acc,
            "mean_kl": mkl,
            "median_kl": medkl,
            "placed_recomputed_share": share,
            "accuracy_system_not_fixed": acc_other,
            "n_system_not_fixed": len(other),
        }
        table.append(row)
    table.sort(
        key=lambda r: (
            r["variant"] != "full",
            list(PREFIXES).index(r["variant"]) if r["variant"] in PREFIXES else -1,
            r["k"],
            r["hops"],
        )
    )
    for r in table:
        print(
            f"{r['variant'] if r['variant'] == 'full' else 'prefix=' + r['variant']:<22}{r['k']:>3}{r['hops']:>5}{r['n']:>4}"
            f"{r['accuracy']:>8.1%}{r['mean_kl']:>9.3f}{r['median_kl']:>9.3f}"
            f"{r['placed_recomputed_share']:>8.1%}{r['accuracy_system_not_fixed']:>13.1%}"
        )
    print(
        f"{len(prompts)} examples ({args.examples} per hops), {args.docs} docs, seed {args.seed}; "
        f"{len(fixed_sys_idx)} use the fixed system prompt; {elapsed:.0f}s"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "self_check": check,
                    "prefixes": {k: PREFIXES[k] for k in args.prefixes},
                    "rows": table,
                    "elapsed_s": elapsed,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
