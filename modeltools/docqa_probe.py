"""CPU probe: which data/loss change makes doc-QA retrieval emerge faster in a tiny model.

Not used by anything else. Trains a tiny Qwen3 (default 4 layers, hidden 128, 4 heads of
32, 2 KV heads) on ``docqa_data`` examples with 2..``--max-docs`` documents, tokenized as
``docqa_train`` does, and prints held-out greedy exact match (``--eval-docs`` documents,
half single-, half two-hop) every ``--eval-every`` steps. Variants:

- ``--answer-space``: the answer text is " Cairo" (the token the documents carry) instead
  of "Cairo", so the answer is a pure copy; exact match compares the variant's own target,
  i.e. the stripped text.
- ``--docs adjacent``: documents put the value right after its subject, e.g.
  ``Home of Mira: Oslo. Age of Mira: 34.`` / ``Base of team Falcon: Lima. Leader of team
  Falcon: Omar.`` (the templates are swapped in this process only).
- ``--loss answer``: loss on the answer and end tokens only; ``--loss lm`` (default): LM
  loss on every token, the answer and end token weighted ``--answer-weight``.

    python -m modeltools.docqa_probe --steps 3000 --answer-space --tag space
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import time

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

from modeltools import docqa_data, docqa_train


def _adjacent_person(p, rng: random.Random) -> str:
    phrases = {
        "city": f"Home of {p.name}: {p.facts.get('city')}.",
        "age": f"Age of {p.name}: {p.facts.get('age')}.",
        "team": f"Team of {p.name}: {p.facts.get('team')}.",
    }
    keys = [k for k in ("city", "age", "team") if k in p.facts]
    rng.shuffle(keys)
    return f"Staff note: {phrases[keys[0]]} {phrases[keys[1]]}\n"


def _adjacent_team(t, rng: random.Random) -> str:
    phrases = [f"Base of team {t.name}: {t.city}.", f"Leader of team {t.name}: {t.leader}."]
    rng.shuffle(phrases)
    return f"Team note: {phrases[0]} {phrases[1]}\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m modeltools.docqa_probe")
    p.add_argument("--tag", default="run")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--max-docs", type=int, default=4)
    p.add_argument("--eval-docs", type=int, default=4)
    p.add_argument("--eval-examples", type=int, default=256)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--answer-space", action="store_true")
    p.add_argument("--docs", choices=("orig", "adjacent"), default="orig")
    p.add_argument("--loss", choices=("lm", "answer"), default="lm")
    p.add_argument("--answer-weight", type=float, default=5.0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--time-limit-s", type=float, default=480)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.docs == "adjacent":  # this process only
        docqa_data.person_document = _adjacent_person
        docqa_data.team_document = _adjacent_team

    def fix(ex):
        return dataclasses.replace(ex, answer=" " + ex.answer) if args.answer_space else ex

    tok = docqa_train.build_docqa_tokenizer()
    cfg = Qwen3Config(
        vocab_size=docqa_train.VOCAB_SIZE,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        intermediate_size=3 * args.hidden,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg).float().train()
    dev = torch.device("cpu")
    evalset = [fix(e) for e in docqa_train.heldout_set(7, args.eval_examples, args.eval_docs)]
    print(f"[{args.tag}] {vars(args)}", flush=True)
    print(f"[{args.tag}] sample doc: {evalset[0].documents[0]!r} answer {evalset[0].answer!r}")
    opt = docqa_train._optimizer(model, docqa_train.TrainConfig(lr=args.lr), dev)
    rng = random.Random(f"probe/{args.seed}")  # same stream for every variant
    start, loss_sum = time.perf_counter(), 0.0
    for step in range(1, args.steps + 1):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, step / args.warmup)
        exs = [
            fix(docqa_data.generate_example(rng, rng.randint(2, args.max_docs), "train"))
            for _ in range(args.batch_size)
        ]
        inputs, targets, w = docqa_train.encode_batch(tok, exs, 2.0)
        is_answer = w == 2.0
        if args.loss == "answer":
            w = is_answer.float()
        else:
            w = torch.where(is_answer, args.answer_weight, w)
        logits = model(input_ids=inputs).logits
        losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        loss = (losses * w).sum() / w.sum()
        ans_loss = (losses * is_answer).sum() / is_answer.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_sum += ans_loss.item()
        last = step == args.steps or time.perf_counter() - start > args.time_limit_s
        if step % args.eval_every == 0 or last:
            ok = docqa_train.exact_match(model, tok, evalset, dev, 64)
            acc = docqa_train.accuracy_by_hops(evalset, ok)
            n = args.eval_every if step % args.eval_every == 0 else step % args.eval_every
            print(
                f"[{args.tag}] step {step} answer-loss {loss_sum / n:.3f} "
                f"heldout {args.eval_docs}docs all {sum(ok) / len(ok):.3f} "
                + " ".join(f"{k} {v:.3f}" for k, v in acc.items())
                + f" {time.perf_counter() - start:.0f}s",
                flush=True,
            )
            loss_sum = 0.0
        if last:
            break
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
