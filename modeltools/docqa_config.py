"""The doc-QA trainer's settings (``TrainConfig``), apart from the trainer
(``modeltools.docqa_train``) so that what only reads them imports neither torch nor
transformers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    steps: int = 12000
    batch_size: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 300
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    answer_weight: float = 5.0  # loss weight of the answer tokens and the end token
    prompt_weight: float = 0.1  # loss weight of every other token (0: answers only)
    turns: int = 8  # questions per training conversation (later ones as follow-up turns)
    reverse: bool = False  # follow-ups may be reverse questions (a value asks for its subject)
    # replies start with a space: " Oslo", the token the documents hold (byte-level BPE
    # keeps the space with the word after it), instead of "Oslo", a different token
    answer_space: bool = True
    # weight of the attention guides' loss (modeltools.docqa_guides); 0: none. Needs
    # answer_space (a guide points at the document token the answer copies)
    guide_weight: float = 1.0
    lr_schedule: str = "wsd"  # "wsd": warmup, constant, linear decay over decay_frac; "cosine"
    decay_frac: float = 0.2  # share of the steps the wsd schedule decays over (to min_lr_ratio)
    curriculum: str = "gated"  # "gated" (accuracy-gated), "linear" or a schedule "0:4,900:6,..."
    curriculum_start: int = 4  # max documents at the start (gated); examples draw [2, max]
    gate_accuracy: float = (
        0.9  # gated: add 2 documents once held-out accuracy at the max reaches this
    )
    gate_every: int = 250  # gated: steps between gate checks
    gate_examples: int = 256  # gated: held-out examples per check
    curriculum_frac: float = 0.8  # linear: max documents reach 16 at this share of steps; gated:
    # a floor that rises 4 -> 16 from floor_start_frac to this share (of steps, or of the
    # time budget where one is given)
    floor_start_frac: float = 0.45
    eval_every: int = 500
    eval_examples: int = 512  # held-out, 8 documents, half single- half two-hop
    final_eval_examples: int = 2000
    log_every: int = 100
    time_budget_s: float | None = None  # training time; steps fitted to it up front
    device: str | None = None  # None: cuda where available
    num_workers: int | None = None  # data-loader processes; None: up to 8 on cuda, else 0
    init_from: str | None = None  # continue from this checkpoint's weights
    # share of training conversations phrased in docqa_phrasing's varied templates
    # (their training split), with names and places from outside the entity lists
    varied_share: float = 0.0
    # the varied conversations' phrasings: "train" (docqa_phrasing's training templates)
    # or "composed" (those, and facts and questions composed from parts)
    varied_templates: str = "train"
    json_share: float = 0.0  # share of conversations whose replies are {"answer": ...}
    # whether a JSON reply's opening token ("{") is a training target. The JSON grammar
    # of ``response_format`` forces it at inference, so by default it is left out of the
    # loss: the model then never learns to choose the JSON form unprompted (runs before
    # this option trained it; true replays them)
    json_opening_loss: bool = False
    seed: int = 0
