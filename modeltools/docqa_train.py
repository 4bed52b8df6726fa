"""Training and evaluating the doc-QA model (``make-model --preset docqa``).

The model is a small Qwen3 (``modeltools.model_config.PRESETS["docqa"]``) trained from
scratch on ``modeltools.docqa_data`` conversations, tokenized exactly as the engine
serves them: the prompt is ``chunk_conversation``'s canonical chunk-by-chunk
tokenization, the target is the assistant turn the ChatML template renders — the answer,
then ``<|im_end|>`` (an id the engine stops on). Ordinary causal attention over whole
conversations; the loss weights answers (``answer_weight``) and all other tokens
(``prompt_weight``, 0 for answers only) apart. ``turns`` > 1 adds follow-up questions
over the same documents as further user/assistant turns: more answers to learn from per
conversation, at little more length (the documents dominate it).

Invariants:
- The tokenizer is deterministic (shipped corpus + generated doc-QA text, fixed seed);
  every entity is one token, with and without a leading space.
- Given the arguments, the data stream, the curriculum and the initial weights are
  deterministic (GPU kernels may still differ in the last bits). With a time budget the
  number of steps is chosen once, from a short timing run, before training starts, and
  recorded in training.json; ``--steps`` with that number reproduces the run.
- The output directory has the layout ``make_model`` writes (config.json,
  model.safetensors, generation_config.json, tokenizer files) plus training.json.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen3ForCausalLM

from modeltools import docqa_data
from modeltools.docqa_config import TrainConfig, add_train_arguments, train_overrides
from modeltools.docqa_data import DocQAExample
from modeltools.docqa_guides import GuideFinder, guide_heads, guide_loss, guide_tensor
from modeltools.model_config import (
    DTYPES,
    build_config,
    check_out_dir,
    clear_stale_weights,
    dtype_name,
    write_config,
    write_generation_config,
)
from modeltools.tokenizer_builder import build_tokenizer, chat_family, save_tokenizer

FAMILY = "qwen3"
VOCAB_SIZE = 1536
TOKENIZER_SEED = 0
TOKENIZER_EXAMPLES = 3000
_HELDOUT_EVAL_SEED = 7  # held-out stream used while training (final eval uses others)


# -- tokenization -----------------------------------------------------------------------


def build_docqa_tokenizer() -> PreTrainedTokenizerFast:
    tokenizer = build_tokenizer(
        FAMILY, VOCAB_SIZE, docqa_data.tokenizer_texts(TOKENIZER_SEED, TOKENIZER_EXAMPLES)
    )
    split = [
        w
        for w in docqa_data.entity_words()
        if len(tokenizer.encode(w)) != 1 or len(tokenizer.encode(" " + w)) != 1
    ]
    if split:
        raise ValueError(f"doc-QA entities that are not single tokens: {split[:10]}")
    return tokenizer


def chunk_texts(ex: DocQAExample) -> list[str]:
    """The chunk texts ``chunk_conversation`` renders for ``ex.messages`` with the ChatML
    template (system, one per document, the question, the generation prompt); fast path
    for training, checked against the real thing by ``check_tokenization``."""
    docs = list(ex.documents)
    return [
        f"<|im_start|>system\n{ex.system}<|im_end|>\n",
        f"<|im_start|>user\n{docs[0]}",
        *docs[1:],
        f"{ex.question}<|im_end|>\n",
        "<|im_start|>assistant\n",
    ]


def prompt_ids(tokenizer: PreTrainedTokenizerFast, ex: DocQAExample) -> list[int]:
    encodings = tokenizer.backend_tokenizer.encode_batch(chunk_texts(ex), add_special_tokens=False)
    return [t for e in encodings for t in e.ids]


def answer_ids(
    tokenizer: PreTrainedTokenizerFast, ex: DocQAExample, answer_space: bool = True
) -> list[int]:
    """The assistant turn's tokens up to the end-of-turn token the engine stops on."""
    end = tokenizer.convert_tokens_to_ids(chat_family(FAMILY).eos)
    text = ex.reply(ex.answer, answer_space)
    return tokenizer.encode(text, add_special_tokens=False) + [end]


def _batch_ids(
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[DocQAExample],
    answer_space: bool = True,
) -> list[list[tuple[list[int], bool]]]:
    """Every example's conversation as (token ids, is an answer) segments, from one
    tokenizer call: the prompt, the answer and end token, then for each follow-up the
    next user turn with the generation prompt and its answer and end token."""
    end = tokenizer.convert_tokens_to_ids(chat_family(FAMILY).eos)
    texts, layouts = [], []
    for ex in examples:
        chunks = chunk_texts(ex)
        layout = [(len(texts), len(chunks), False), (len(texts) + len(chunks), 1, True)]
        texts += [*chunks, ex.reply(ex.answer, answer_space)]
        for question, answer in ex.follow_ups:
            layout.append((len(texts), 1, False))
            layout.append((len(texts) + 1, 1, True))
            user = f"\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
            texts += [user, ex.reply(answer, answer_space)]
        layouts.append(layout)
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    out = []
    for layout in layouts:
        segments = []
        for first, n, is_answer in layout:
            ids = [t for e in encodings[first : first + n] for t in e.ids]
            segments.append(([*ids, end] if is_answer else ids, is_answer))
        out.append(segments)
    return out


def check_tokenization(
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[DocQAExample],
    answer_space: bool = True,
) -> None:
    """Raises unless the fast paths equal the engine's canonical tokenization: the
    prompt as ``chunk_conversation`` serves it, and a training conversation (follow-ups
    included) as the chat template renders it."""
    from chunkstore.chunking import chunk_conversation

    end = tokenizer.convert_tokens_to_ids(chat_family(FAMILY).eos)
    batch = _batch_ids(tokenizer, examples, answer_space)
    for ex, segments in zip(examples, batch, strict=True):
        canonical = [t for c in chunk_conversation(tokenizer, ex.messages) for t in c.token_ids]
        if canonical != prompt_ids(tokenizer, ex):
            raise AssertionError(f"fast tokenization differs from chunk_conversation: {ex}")
        full = [
            t
            for c in chunk_conversation(
                tokenizer, ex.conversation(answer_space), add_generation_prompt=False
            )
            for t in c.token_ids
        ]
        trained = [t for ids, _ in segments for t in ids]
        # the template closes the last turn with a newline the training sequence omits
        if full[: len(trained)] != trained or tokenizer.decode(full[len(trained) :]) != "\n":
            raise AssertionError(f"training conversation differs from the chat template: {ex}")
        if trained[-1] != end:
            raise AssertionError("a training conversation must end with the end-of-turn token")


# -- batches ----------------------------------------------------------------------------


def parse_schedule(text: str) -> list[tuple[int, int]]:
    """``"0:4,900:6,1500:8"`` -> [(0, 4), (900, 6), (1500, 8)] (from step, max documents)."""
    points = []
    for item in text.split(","):
        step, _, docs = item.partition(":")
        points.append((int(step), int(docs)))
    if not points or points[0][0] != 0 or sorted(points) != points:
        raise ValueError(f"curriculum schedule must start at step 0 and be sorted: {text!r}")
    if not all(docqa_data.MIN_DOCS <= d <= docqa_data.MAX_DOCS for _, d in points):
        raise ValueError(f"curriculum schedule documents out of range: {text!r}")
    return points


def gated_floor(progress: float, cfg: TrainConfig) -> int:
    """Gated curriculum: least max documents at ``progress`` (share of the steps or of the
    time budget), so that a gate that stalls still reaches 16 documents."""
    span = max(1e-9, cfg.curriculum_frac - cfg.floor_start_frac)
    grown = int(12 * min(1.0, max(0.0, (progress - cfg.floor_start_frac) / span)))
    return min(docqa_data.MAX_DOCS, 4 + grown)


def max_docs_at(step: int, cfg: TrainConfig) -> int:
    """Max documents at ``step`` of the linear or scheduled curriculum (documents per
    example are drawn from [2, max]); the gated one's loader is told its max instead."""
    if cfg.curriculum == "linear":
        if step < cfg.warmup_steps:
            return 4
        ramp = max(1.0, cfg.curriculum_frac * cfg.steps)
        return min(docqa_data.MAX_DOCS, 4 + int(12 * step / ramp))
    if cfg.curriculum == "gated":
        return docqa_data.MIN_DOCS
    return max(d for s, d in parse_schedule(cfg.curriculum) if s <= step)


def encode_batch(
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[DocQAExample],
    answer_weight: float,
    prompt_weight: float = 1.0,
    answer_space: bool = True,
    guides: GuideFinder | None = None,
    json_opening: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, target ids, loss weights, attention guides), right-padded; targets are
    the next tokens, weighted ``answer_weight`` in answers (end tokens included), else
    ``prompt_weight``; guides as ``docqa_guides.guide_tensor`` (none without a finder,
    and none for examples the finder cannot read: varied phrasings, JSON replies).
    ``json_opening`` False: the first token of every JSON reply (the "{" the grammar
    forces) weighs 0, so that it is no target."""
    seqs, weights, guide_rows = [], [], []
    batch = _batch_ids(tokenizer, examples, answer_space)
    for ex, segments in zip(examples, batch, strict=True):
        guided = guides is not None and ex.style == "plain" and not ex.json_replies
        guide_rows.append(guides.guides(segments) if guided else [])
        seq, w = [], []
        for ids, is_answer in segments:
            seq += ids
            w += [answer_weight if is_answer else prompt_weight] * len(ids)
            if is_answer and ex.json_replies and not json_opening:
                w[len(w) - len(ids)] = 0.0
        seqs.append(seq)
        weights.append(w[1:])  # weight of predicting token i+1 from position i
    length = -(-(max(len(s) for s in seqs) - 1) // 16) * 16  # a multiple of 16
    pad = tokenizer.pad_token_id
    rows = [s + [pad] * (length + 1 - len(s)) for s in seqs]
    ids = torch.tensor(rows, dtype=torch.long)
    w = torch.tensor([ws + [0.0] * (length - len(ws)) for ws in weights])
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), w, guide_tensor(guide_rows)


class _Batches(torch.utils.data.IterableDataset):
    """Training batches; worker k of n makes the batches of steps k, k+n, ... (the
    order a DataLoader reads its workers in), each from its own seeded generator, so
    the stream does not depend on the number of workers."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        cfg: TrainConfig,
        first_step: int = 0,
        gated_docs: int = 0,
    ):
        self.tokenizer, self.cfg, self.first_step = tokenizer, cfg, first_step
        self.gated_docs = gated_docs  # the gate's max documents (gated curriculum)
        self.guides = GuideFinder(tokenizer) if cfg.guide_weight > 0 else None

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        step = self.first_step + worker
        while True:
            rng = random.Random(f"docqa-train/{self.cfg.seed}/{step}")
            high = max(self.gated_docs, max_docs_at(step, self.cfg))
            examples = [
                training_example(rng, rng.randint(docqa_data.MIN_DOCS, high), self.cfg)
                for _ in range(self.cfg.batch_size)
            ]
            yield encode_batch(
                self.tokenizer,
                examples,
                self.cfg.answer_weight,
                self.cfg.prompt_weight,
                self.cfg.answer_space,
                self.guides,
                self.cfg.json_opening_loss,
            )
            step += workers


def training_example(rng: random.Random, num_docs: int, cfg: TrainConfig) -> DocQAExample:
    """One training conversation: varied phrasing and JSON replies each drawn at their
    share (the generator is not drawn from for a share of 0, so the plain recipe's
    stream stays as it was)."""
    style = "varied" if cfg.varied_share > 0 and rng.random() < cfg.varied_share else "plain"
    as_json = cfg.json_share > 0 and rng.random() < cfg.json_share
    return docqa_data.generate_example(
        rng,
        num_docs,
        "train",
        questions=cfg.turns,
        reverse=cfg.reverse,
        style=style,
        templates=cfg.varied_templates if style == "varied" else "train",
        json_replies=as_json,
    )


def _loader(tokenizer, cfg: TrainConfig, workers: int, first_step: int = 0, gated_docs: int = 0):
    return torch.utils.data.DataLoader(
        _Batches(tokenizer, cfg, first_step, gated_docs),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=False,
    )


# -- evaluation -------------------------------------------------------------------------


def heldout_set(
    seed: int, count: int, num_docs: int, style: str = "plain", templates: str = "train"
) -> list[DocQAExample]:
    """``count`` held-out examples, half single-hop then half two-hop, phrased in
    ``style`` with the ``templates`` split's templates."""
    half = count // 2
    out = []
    for offset, hops, n in ((0, 1, half), (1, 2, count - half)):
        if style == "plain":  # the stream docqa_data.generate has always given
            out += docqa_data.generate(seed + offset, n, num_docs, "heldout", hops=hops)
            continue
        rng = random.Random(f"docqa/heldout/{style}/{templates}/{seed + offset}")
        out += [
            docqa_data.generate_example(
                rng, num_docs, "heldout", hops, style=style, templates=templates
            )
            for _ in range(n)
        ]
    return out


def conversation_set(
    seed: int,
    count: int,
    num_docs: int,
    turns: int,
    style: str = "plain",
    json_replies: bool = False,
) -> list[DocQAExample]:
    """``count`` held-out conversations of exactly ``turns`` questions over the same
    documents (the first with the documents, the others as later user turns)."""
    rng = random.Random(f"docqa/conversations/{style}/{json_replies}/{seed}")
    out: list[DocQAExample] = []
    while len(out) < count:
        ex = docqa_data.generate_example(
            rng, num_docs, "heldout", questions=turns, style=style, json_replies=json_replies
        )
        if len(ex.follow_ups) == turns - 1:
            out.append(ex)
    return out


# Held-out sets beyond the plain single-turn ones (``evaluate_sets``): name -> how to
# make ``count`` of them at ``num_docs`` documents from ``seed``
EXTRA_SETS: dict[str, Callable[[int, int, int], list[DocQAExample]]] = {
    "varied": lambda seed, count, n: heldout_set(seed, count, n, "varied"),
    "heldout-templates": lambda seed, count, n: heldout_set(seed, count, n, "varied", "heldout"),
    "2 turns": lambda seed, count, n: conversation_set(seed, count, n, 2),
    "3 turns": lambda seed, count, n: conversation_set(seed, count, n, 3),
    "3 turns, varied": lambda seed, count, n: conversation_set(seed, count, n, 3, "varied"),
    "json": lambda seed, count, n: conversation_set(seed, count, n, 1, json_replies=True),
}


@torch.no_grad()
def exact_match(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    examples: Sequence[DocQAExample],
    device: torch.device,
    batch_size: int = 128,
    answer_space: bool = True,
) -> list[bool]:
    """Greedy exact match per example: the argmax at every position of the assistant
    turn (answer, then end token) is the target given the target before it — which is
    exactly when greedy decoding emits the answer and stops. A JSON reply is judged from
    its second token on: its first, the object's opening, is what the JSON grammar of
    ``response_format`` forces (the model is not asked to choose the format itself)."""
    was_training = model.training
    model.eval()
    out: list[bool] = []
    for i in range(0, len(examples), batch_size):
        chunk = examples[i : i + batch_size]
        inputs, targets, weights, _ = encode_batch(tokenizer, chunk, 2.0, 1.0, answer_space)
        with _autocast(device):
            logits = model(input_ids=inputs.to(device)).logits
        predicted = logits.argmax(-1).cpu()
        is_answer = weights == 2.0
        opening = is_answer & ~F.pad(is_answer, (1, 0))[:, :-1]  # each reply's first token
        forced = torch.tensor([ex.json_replies for ex in chunk]).unsqueeze(1)
        is_answer &= ~(opening & forced)
        ok = ((predicted == targets) | ~is_answer).all(dim=1)
        out += ok.tolist()
    model.train(was_training)
    return out


def accuracy_by_hops(
    examples: Sequence[DocQAExample], ok: Sequence[bool] | Sequence[float]
) -> dict[str, float]:
    """Mean of ``ok`` (hits, or per-example probabilities) per number of hops."""
    result = {}
    for hops in (1, 2):
        hits = [o for ex, o in zip(examples, ok, strict=True) if ex.hops == hops]
        if hits:
            result[f"{hops}hop"] = sum(hits) / len(hits)
    return result


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


# -- training ---------------------------------------------------------------------------


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "wsd":
        decay_start = cfg.steps - max(1, round(cfg.decay_frac * cfg.steps))
        if step < decay_start:
            return cfg.lr
        progress = min(1.0, (step - decay_start) / max(1, cfg.steps - decay_start))
        return cfg.lr * (1 - (1 - cfg.min_lr_ratio) * progress)
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def _optimizer(model: torch.nn.Module, cfg: TrainConfig, device: torch.device):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )


def _step(model, optimizer, batch, device, cfg) -> torch.Tensor:
    """One optimizer step; returns (answer-and-prompt loss, guide loss) detached."""
    inputs, targets, weights, guides = (t.to(device, non_blocking=True) for t in batch)
    guided = cfg.guide_weight > 0
    with _autocast(device):
        out = model(input_ids=inputs, output_attentions=guided)
    losses = F.cross_entropy(out.logits.float().transpose(1, 2), targets, reduction="none")
    loss = (losses * weights).sum() / weights.sum()
    guide = torch.zeros((), device=loss.device)
    if guided:
        guide = guide_loss(out.attentions, guides, guide_heads(model.config.num_hidden_layers))
    parts = torch.stack([loss.detach(), guide.detach()])
    loss = loss + cfg.guide_weight * guide
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return parts


def _fit_steps(model, tokenizer, cfg, device, workers, log, started: float) -> int:
    """Steps that fit ``cfg.time_budget_s``, timed on a throwaway copy of the model."""
    probe = copy.deepcopy(model)
    optimizer = _optimizer(probe, cfg, device)
    late = TrainConfig(**{**asdict(cfg), "seed": cfg.seed + 99991})
    warm, timed = (10, 50) if device.type == "cuda" else (1, 2)
    loader = iter(_loader(tokenizer, late, workers, first_step=cfg.steps - warm - timed))
    for i in range(warm + timed):
        if i == warm:
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
        _step(probe, optimizer, next(loader), device, cfg)
    if device.type == "cuda":
        torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / timed
    # in-loop evaluations cost about as much as a few steps each
    left = cfg.time_budget_s - (time.perf_counter() - started)
    overhead = 6 / max(1, cfg.eval_every)
    if cfg.curriculum == "gated":
        overhead += 4 / max(1, cfg.gate_every)  # gate checks and loader restarts
    steps = int(left / (per_step * (1 + overhead)))
    log(f"timing: {per_step * 1000:.1f} ms/step at full length -> {steps} steps fit the budget")
    del probe, optimizer, loader
    return max(1, min(cfg.steps, steps))


def train(
    model: Qwen3ForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    cfg: TrainConfig,
    log: Callable[[str], None] = print,
) -> dict[str, object]:
    """Trains ``model`` in place; returns a summary (steps, losses, held-out accuracy)."""
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model.to(device).train()
    if cfg.guide_weight > 0:
        guide_heads(model.config.num_hidden_layers)  # fail early on a model too shallow
        model.set_attn_implementation("eager")  # the guides read attention probabilities
    workers = cfg.num_workers
    if workers is None:
        workers = min(8, (os.cpu_count() or 2) - 1) if device.type == "cuda" else 0
    rng = random.Random(f"docqa-check/{cfg.seed}")
    checked = [training_example(rng, rng.randint(2, 16), cfg) for _ in range(20)]
    checked += [
        docqa_data.generate_example(
            rng, rng.randint(2, 16), "train", questions=3, style="varied", json_replies=True
        )
        for _ in range(5)
    ]
    check_tokenization(tokenizer, checked, cfg.answer_space)
    started = time.perf_counter()
    requested_steps = cfg.steps
    gated = cfg.curriculum == "gated"
    # Gated with a time budget: the floor follows the share of the budget spent, and the
    # wsd decay starts at 1 - decay_frac of it, its length fitted to the time left; the
    # summary records the steps, decay and documents schedule that replay the run.
    by_time = gated and cfg.time_budget_s is not None
    if cfg.time_budget_s is not None and not by_time:
        cfg = TrainConfig(
            **{
                **asdict(cfg),
                "steps": _fit_steps(model, tokenizer, cfg, device, workers, log, started),
            }
        )
    if by_time and cfg.lr_schedule != "wsd":
        raise ValueError("a gated curriculum with a time budget needs lr_schedule wsd")
    # the held-out set that picks the kept weights: plain questions, and the varied
    # phrasings and JSON replies where the recipe trains them
    evalset = heldout_set(_HELDOUT_EVAL_SEED, cfg.eval_examples, 8)
    if cfg.varied_share > 0:
        evalset += heldout_set(_HELDOUT_EVAL_SEED, cfg.eval_examples // 2, 8, "varied")
    if cfg.json_share > 0:
        evalset += conversation_set(
            _HELDOUT_EVAL_SEED, cfg.eval_examples // 4, 8, 1, json_replies=True
        )
    if not gated and cfg.curriculum != "linear":
        parse_schedule(cfg.curriculum)  # fail early on a bad schedule
    gate_docs = cfg.curriculum_start if gated else 0
    gate_sets: dict[int, list[DocQAExample]] = {}
    optimizer = _optimizer(model, cfg, device)
    loader = iter(_loader(tokenizer, cfg, workers, 0, gate_docs))
    history: list[dict[str, float]] = []
    schedule: list[tuple[int, int]] = [(0, max(gate_docs, max_docs_at(0, cfg)))]
    best: tuple[float, dict[str, torch.Tensor] | None, int] = (-1.0, None, 0)
    loss_sum, loss_n = torch.zeros(2, device=device), 0
    train_start = time.perf_counter()
    budget_left = (cfg.time_budget_s or 0) - (train_start - started)
    decay_started = not by_time
    marks: list[tuple[int, float]] = [(0, train_start)]  # recent (step, time), for the step rate
    step = -1
    stopped_early = False
    while step + 1 < cfg.steps:
        step += 1
        done = step + 1
        if by_time and not decay_started and step >= cfg.warmup_steps:
            spent = (time.perf_counter() - train_start) / budget_left
            if spent >= 1 - cfg.decay_frac:
                now = time.perf_counter()
                rate = (step - marks[0][0]) / max(1e-6, now - marks[0][1])
                left = int(0.92 * rate * (budget_left - (now - train_start)))
                total = step + max(1, left)
                cfg = TrainConfig(
                    **{**asdict(cfg), "steps": total, "decay_frac": (total - step) / total}
                )
                decay_started = True
                log(f"step {step}: decay over the last {total - step} steps ({rate:.1f} steps/s)")
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        loss_sum += _step(model, optimizer, next(loader), device, cfg)
        loss_n += 1
        if by_time and done % 50 == 0:
            marks = [*marks[-5:], (done, time.perf_counter())]
        if done % cfg.log_every == 0 or done == cfg.steps:
            elapsed = time.perf_counter() - train_start
            mean = (loss_sum / loss_n).tolist()
            guide = f" guide {mean[1]:.3f}" if cfg.guide_weight > 0 else ""
            log(
                f"step {done}/{cfg.steps} loss {mean[0]:.4f}{guide} "
                f"lr {_lr_at(step, cfg):.2e} docs<= {schedule[-1][1]} {elapsed:.0f}s"
            )
            loss_sum, loss_n = torch.zeros(2, device=device), 0
        new_docs = gate_docs
        if (
            gated
            and done % cfg.gate_every == 0
            and gate_docs < docqa_data.MAX_DOCS
            and done < cfg.steps
        ):
            if gate_docs not in gate_sets:
                gate_sets[gate_docs] = heldout_set(
                    _HELDOUT_EVAL_SEED + 100 * gate_docs, cfg.gate_examples, gate_docs
                )
            acc = accuracy_by_hops(
                gate_sets[gate_docs],
                exact_match(
                    model, tokenizer, gate_sets[gate_docs], device, answer_space=cfg.answer_space
                ),
            )
            score = sum(acc.values()) / len(acc)
            log(f"step {done} gate at {gate_docs} docs: {_accuracy_text(acc)}")
            if score >= cfg.gate_accuracy:
                new_docs = min(docqa_data.MAX_DOCS, gate_docs + 2)
                log(f"step {done}: gate passed, documents now up to {new_docs}")
            if by_time:
                progress = (time.perf_counter() - train_start) / budget_left
            else:
                progress = done / cfg.steps
            floor = gated_floor(progress, cfg)
            if floor > new_docs:
                new_docs = floor
                log(f"step {done}: curriculum floor, documents now up to {new_docs}")
        if new_docs != gate_docs:
            gate_docs = new_docs
            schedule.append((done, gate_docs))
            del loader
            loader = iter(_loader(tokenizer, cfg, workers, done, gate_docs))
        if not gated and max_docs_at(done, cfg) != schedule[-1][1] and done < cfg.steps:
            schedule.append((done, max_docs_at(done, cfg)))
        if done % cfg.eval_every == 0 or done == cfg.steps:
            ok = exact_match(model, tokenizer, evalset, device, answer_space=cfg.answer_space)
            acc = accuracy_by_hops(evalset, ok)
            history.append({"step": done, **acc})
            log(f"step {done} held-out 8 docs: {_accuracy_text(acc)}")
            score = sum(acc.values()) / len(acc)
            if score >= best[0]:
                state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
                best = (score, state, done)
        if (
            cfg.time_budget_s is not None
            and time.perf_counter() - started > cfg.time_budget_s + 30 * by_time
        ):
            log(f"time budget reached after {done} steps")
            stopped_early = True
            break
    if best[1] is not None and best[2] != step + 1:
        log(f"restoring the weights of step {best[2]} (best held-out accuracy)")
        model.load_state_dict(best[1])
    final = final_evaluation(model, tokenizer, cfg, device, log)
    return {
        "requested_steps": requested_steps,
        "steps": cfg.steps,
        "steps_done": step + 1,
        "stopped_early": stopped_early,
        "kept_step": best[2] or step + 1,
        "decay_frac": cfg.decay_frac,
        # max documents from each step on: passing it as --curriculum replays the run
        "curriculum_schedule": ",".join(f"{a}:{b}" for a, b in schedule),
        "train_seconds": round(time.perf_counter() - train_start, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "history": history,
        "heldout": final,
    }


def final_evaluation(
    model, tokenizer, cfg: TrainConfig, device, log
) -> dict[str, dict[str, float]]:
    results = {}
    for num_docs in (4, 8, 16):
        count = cfg.final_eval_examples if num_docs == 8 else cfg.final_eval_examples // 2
        examples = heldout_set(1000 + num_docs, max(2, count), num_docs)
        ok = exact_match(model, tokenizer, examples, device, answer_space=cfg.answer_space)
        acc = accuracy_by_hops(examples, ok)
        chance = relation_chance_by_hops(examples)
        results[f"{num_docs}docs"] = {**acc, "examples": len(examples), "relation_chance": chance}
        log(f"final held-out {num_docs} docs ({len(examples)}): {_versus_chance(acc, chance)}")
    extra = evaluate_sets(
        model, tokenizer, device, list(EXTRA_SETS), 8, cfg.final_eval_examples // 4,
        1100, cfg.answer_space,
    )  # fmt: skip
    for name, acc in extra.items():
        results[f"8docs, {name}"] = acc
        log(f"final held-out 8 docs, {name} ({acc['examples']}): {_accuracy_text(acc)}")
    return results


def evaluate_sets(
    model, tokenizer, device, names: Sequence[str], num_docs: int, count: int, seed: int,
    answer_space: bool = True,
) -> dict[str, dict[str, float]]:  # fmt: skip
    """Greedy exact match on the ``EXTRA_SETS`` named: per hops of the first question,
    a conversation counting as right only when every one of its answers is."""
    out = {}
    for name in names:
        examples = EXTRA_SETS[name](seed, count, num_docs)
        ok = exact_match(model, tokenizer, examples, device, 32, answer_space)
        out[name] = {**accuracy_by_hops(examples, ok), "examples": len(examples)}
    return out


def _accuracy_text(acc: Mapping[str, float]) -> str:
    """``1hop 1.000 2hop 0.985``: each figure of ``acc`` but its example count."""
    return " ".join(f"{k} {v:.3f}" for k, v in acc.items() if k != "examples")


def relation_chance_by_hops(examples: Sequence[DocQAExample]) -> dict[str, float]:
    """``docqa_data.relation_chance`` averaged per number of hops."""
    return accuracy_by_hops(examples, [docqa_data.relation_chance(ex) for ex in examples])


def _versus_chance(acc: Mapping[str, float], chance: Mapping[str, float]) -> str:
    return f"{_accuracy_text(acc)} (relation-only chance {_accuracy_text(chance)})"


# -- the checkpoint ---------------------------------------------------------------------


def make_docqa_model(
    out_dir: str | Path,
    seed: int = 0,
    overrides: Mapping[str, object] | None = None,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
    **train_options: object,
) -> Path:
    """Trains the doc-QA model and writes it to ``out_dir`` in the Hugging Face layout.
    ``train_options`` are ``TrainConfig`` fields (steps, batch_size, lr, ...)."""
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(train_options) - known)
    if unknown:
        raise ValueError(f"unknown training option(s) {unknown}; known: {sorted(known)}")
    cfg = TrainConfig(**{**train_options, "seed": seed})  # type: ignore[arg-type]
    if cfg.steps < 1 or cfg.batch_size < 1 or cfg.turns < 1:
        raise ValueError("steps, batch_size and turns must be positive")
    if cfg.answer_weight <= 0 or cfg.prompt_weight < 0:
        raise ValueError("answer_weight must be positive and prompt_weight not negative")
    if cfg.guide_weight < 0 or (cfg.guide_weight > 0 and not cfg.answer_space):
        raise ValueError("guide_weight must be 0, or positive with answer_space")
    if cfg.varied_templates not in ("train", "composed"):
        raise ValueError(f"varied_templates is train or composed, got {cfg.varied_templates!r}")
    for name in ("varied_share", "json_share"):
        if not 0 <= getattr(cfg, name) <= 1:
            raise ValueError(
                f"{name} is a share of conversations in [0, 1], got {getattr(cfg, name)}"
            )
    out = Path(out_dir)
    check_out_dir(out, overwrite)
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    tokenizer = build_docqa_tokenizer()
    config = build_config("docqa", FAMILY, tokenizer, overrides, dtype)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).float()
    if cfg.init_from:
        _load_weights(model, Path(cfg.init_from))
        log(f"initialised from {cfg.init_from}")
    n_params = sum(p.numel() for p in model.parameters())
    log(f"doc-QA model: {n_params / 1e6:.2f}M parameters, vocab {config.vocab_size}")
    summary = train(model, tokenizer, cfg, log)
    model.set_attn_implementation("sdpa")
    summary = {"seed": seed, "parameters": n_params, "config": asdict(cfg), **summary}
    clear_stale_weights(out)
    weight_dtype = DTYPES[dtype_name(config.dtype)]
    state = {
        k: v.detach().to("cpu", weight_dtype).contiguous()
        for k, v in model.state_dict().items()
        if not (config.tie_word_embeddings and k == "lm_head.weight")
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    write_config(out, config)
    write_generation_config(out, tokenizer, FAMILY)
    tokenizer.model_max_length = config.max_position_embeddings
    save_tokenizer(tokenizer, out)
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out


def _load_weights(model: torch.nn.Module, source: Path) -> None:
    state = load_file(source / "model.safetensors")
    own = model.state_dict()
    if "lm_head.weight" not in state and "lm_head.weight" in own:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    mismatched = sorted(k for k in own if k not in state or state[k].shape != own[k].shape)
    if mismatched:
        raise ValueError(f"{source}: weights do not fit this model: {mismatched[:5]}")
    model.load_state_dict({k: v.float() for k, v in state.items()})


def blend_checkpoints(
    out_dir: str | Path,
    tuned: str | Path,
    base: str | Path,
    weight: float,
    eval_examples: int = 2000,
    device: str | None = None,
    overwrite: bool = False,
    log: Callable[[str], None] | None = None,
) -> Path:
    """Writes ``weight`` x ``tuned``'s weights + (1 - weight) x ``base``'s to ``out_dir``
    (``tuned`` fine-tuned from ``base``: a point on the line between them, which can keep
    what the fine-tune gained and what it lost), with ``tuned``'s other files, then runs
    training's final evaluation on it (``eval_examples`` as ``final_eval_examples``;
    float32, on ``device``, the CPU by default). training.json is ``tuned``'s, with the
    blend's evaluation as ``heldout``, ``tuned``'s as ``tuned_heldout``, the weight
    under ``blend`` and ``base``'s training.json under ``base``."""
    if not 0 <= weight <= 1:
        raise ValueError(f"weight is a share in [0, 1], got {weight}")
    tuned, base, out = Path(tuned), Path(base), Path(out_dir)
    check_out_dir(out, overwrite)
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    a, b = load_file(tuned / "model.safetensors"), load_file(base / "model.safetensors")
    if {k: v.shape for k, v in a.items()} != {k: v.shape for k, v in b.items()}:
        raise ValueError(f"{tuned} and {base} are not checkpoints of one shape")
    clear_stale_weights(out)
    for f in tuned.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "training.json"):
            (out / f.name).write_bytes(f.read_bytes())
    state = {
        k: (weight * v.float() + (1 - weight) * b[k].float()).to(v.dtype).contiguous()
        for k, v in a.items()
    }
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    summary = json.loads((tuned / "training.json").read_text())
    model, tokenizer = load_for_eval(out, device or "cpu")
    dev = next(model.parameters()).device
    cfg = TrainConfig(final_eval_examples=eval_examples, answer_space=answer_space_of(tuned))
    log(f"blend: {weight} x {tuned} + {1 - weight:.2f} x {base}")
    heldout = final_evaluation(model, tokenizer, cfg, dev, log)
    summary = {
        **summary,
        "tuned_heldout": summary.get("heldout"),
        "heldout": heldout,
        "blend": {"weight": weight, "device": str(dev), "dtype": "float32"},
        "base": json.loads((base / "training.json").read_text()),
    }
    (out / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    return out


def answer_space_of(model_dir: str | Path) -> bool:
    """Whether the checkpoint's replies start with a space (its training.json says)."""
    info = Path(model_dir) / "training.json"
    if not info.exists():
        return False
    return bool(json.loads(info.read_text()).get("config", {}).get("answer_space", False))


def load_for_eval(model_dir: str | Path, device: str | None = None):
    """(model, tokenizer) of a doc-QA checkpoint via transformers, float32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(dev).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m modeltools.docqa_train eval DIR [--docs 8] [--examples 400]``,
    ``train DIR [--FIELD VALUE ...]``: ``make_docqa_model`` with any ``TrainConfig``
    field (``chunkserve make-model --preset docqa`` takes the same), or ``blend DIR
    TUNED BASE --weight W``: ``blend_checkpoints``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m modeltools.docqa_train")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train the doc-QA model (make-model --preset docqa)")
    t.add_argument("dir")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--overwrite", action="store_true")
    add_train_arguments(t)
    b = sub.add_parser(
        "blend", help="weight x TUNED + (1 - weight) x BASE, evaluated as training's end"
    )
    b.add_argument("dir")
    b.add_argument("tuned")
    b.add_argument("base")
    b.add_argument("--weight", type=float, required=True, help="TUNED's share")
    b.add_argument("--final-eval-examples", type=int, default=2000)
    b.add_argument("--device")
    b.add_argument("--overwrite", action="store_true")
    e = sub.add_parser("eval", help="held-out exact match of a checkpoint (transformers)")
    e.add_argument("dir")
    e.add_argument("--docs", type=int, nargs="+", default=[4, 8, 16])
    e.add_argument("--examples", type=int, default=400)
    e.add_argument("--seed", type=int, default=2000)
    e.add_argument(
        "--sets",
        nargs="*",
        default=[],
        choices=list(EXTRA_SETS),
        help="also these held-out sets (varied phrasings, held-out templates, conversations "
        "of several turns, JSON replies), at each --docs",
    )
    e.add_argument("--device")
    args = p.parse_args(argv)
    if args.cmd == "train":
        make_docqa_model(args.dir, args.seed, overwrite=args.overwrite, **train_overrides(args))
        return 0
    if args.cmd == "blend":
        blend_checkpoints(
            args.dir, args.tuned, args.base, args.weight, args.final_eval_examples,
            args.device, args.overwrite,
        )  # fmt: skip
        return 0
    model, tokenizer = load_for_eval(args.dir, args.device)
    dev = next(model.parameters()).device
    space = answer_space_of(args.dir)
    for n in args.docs:
        examples = heldout_set(args.seed + n, args.examples, n)
        acc = accuracy_by_hops(examples, exact_match(model, tokenizer, examples, dev, 32, space))
        print(
            f"{n} docs ({len(examples)}): {_versus_chance(acc, relation_chance_by_hops(examples))}"
        )
        extra = evaluate_sets(model, tokenizer, dev, args.sets, n, args.examples, args.seed, space)
        for name, acc in extra.items():
            print(f"{n} docs, {name} ({acc['examples']}): {_accuracy_text(acc)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
