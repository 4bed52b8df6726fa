"""The doc-QA trainer's settings (``TrainConfig``) and their command-line options, one
``--field-name`` a field with the help its metadata holds: `chunkserve make-model
--preset docqa` and `python -m modeltools.docqa_train train` both take them
(``add_train_arguments``, ``train_overrides``). Apart from the trainer
(``modeltools.docqa_train``), so that what only reads them imports neither torch nor
transformers."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields


def _setting(default: object, help: str) -> object:
    """A field whose default the option's help shows (where it is not None)."""
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    steps: int = _setting(12000, "optimizer steps")
    batch_size: int = _setting(128, "conversations per step")
    lr: float = _setting(1e-3, "peak learning rate (warmup, then --lr-schedule)")
    min_lr_ratio: float = _setting(0.05, "final learning rate over the peak")
    warmup_steps: int = _setting(300, "learning-rate warmup steps")
    weight_decay: float = _setting(0.1, "AdamW weight decay of matrices")
    grad_clip: float = _setting(1.0, "gradient norm clip")
    answer_weight: float = _setting(5.0, "loss weight of answer and end tokens")
    prompt_weight: float = _setting(
        0.1, "loss weight of every other token; 0 trains on answers only"
    )
    turns: int = _setting(
        8,
        "questions per training conversation, the later ones as follow-up turns over the "
        "same documents",
    )
    reverse: bool = _setting(
        False,
        "true: follow-ups may also ask a value for its subject ('Who lives in Oslo?'), "
        "which trains the binding forward questions need",
    )
    # byte-level BPE keeps the space with the word after it: " Oslo" is another token
    # than "Oslo"
    answer_space: bool = _setting(
        True,
        "true: replies start with a space (' Oslo'), the token the documents hold, so "
        "answering is copying a document token",
    )
    guide_weight: float = _setting(
        1.0,
        "weight of the attention-guide loss (modeltools.docqa_guides) that teaches four "
        "heads to bind values to their subjects and look answers up (needs --answer-space "
        "true: a guide points at the document token the answer copies; 0: none)",
    )
    lr_schedule: str = _setting("wsd", "wsd (warmup, constant, linear decay) or cosine")
    decay_frac: float = _setting(0.2, "share of the steps the wsd schedule decays over")
    curriculum: str = _setting(
        "gated",
        "gated (documents grow 4 -> 16 by 2 as held-out accuracy passes --gate-accuracy), "
        "linear, or a schedule STEP:DOCS,... to replay",
    )
    curriculum_start: int = _setting(
        4, "gated: max documents per example at the start (examples draw [2, max])"
    )
    gate_accuracy: float = _setting(
        0.9, "gated: held-out accuracy at the current max that adds 2 documents"
    )
    gate_every: int = _setting(250, "gated: steps between gate checks")
    gate_examples: int = _setting(256, "gated: held-out examples per gate check")
    curriculum_frac: float = _setting(
        0.8,
        "linear: share of steps over which documents grow 4 -> 16; gated: share (of steps, "
        "or of --time-budget-s) by which a floor rising from --floor-start-frac reaches 16",
    )
    floor_start_frac: float = _setting(0.45, "gated: share where the floor starts rising from 4")
    eval_every: int = _setting(500, "steps between held-out evaluations")
    eval_examples: int = _setting(
        512, "held-out examples per evaluation (8 documents, half single-, half two-hop)"
    )
    final_eval_examples: int = _setting(2000, "held-out 8-document examples at the end")
    log_every: int = _setting(100, "steps between loss lines")
    time_budget_s: float | None = _setting(
        None, "fit the number of steps to this many seconds of training (default: none)"
    )
    device: str | None = _setting(None, "cuda or cpu (default: cuda where available)")
    num_workers: int | None = _setting(
        None, "data-loader processes (default: up to 8 on cuda, else 0)"
    )
    init_from: str | None = _setting(None, "continue from this checkpoint's weights")
    varied_share: float = _setting(
        0.0,
        "share of conversations phrased in varied templates (modeltools/docqa_phrasing.py, "
        "their training split), with distractor sentences and names from outside the "
        "entity lists",
    )
    varied_templates: str = _setting(
        "train",
        "the varied conversations' phrasings: train (the training templates) or composed "
        "(those, and facts and questions composed from parts; never a held-out one)",
    )
    json_share: float = _setting(
        0.0, 'share of conversations whose replies are the JSON object {"answer": ...}'
    )
    json_opening_loss: bool = _setting(
        False,
        "true: the '{' opening a JSON reply is trained too, so the model may open one "
        "unasked; false leaves it to the grammar of response_format, which supplies it "
        "(runs before this option trained it: true replays them)",
    )
    seed: int = 0  # the data and weight seed: each command line has its own --seed


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _parse_bool(option: str) -> Callable[[str], bool]:
    words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

    def parse(text: str) -> bool:
        value = words.get(text.lower())
        if value is None:
            raise argparse.ArgumentTypeError(f"{option} takes true or false, got {text!r}")
        return value

    return parse


def _trained_fields():
    return [f for f in fields(TrainConfig) if f.name != "seed"]


def add_train_arguments(group: argparse._ActionsContainer) -> None:
    """``--field-name VALUE`` for every ``TrainConfig`` field but ``seed`` (stored as
    ``train_<field>``, None where not given)."""
    for f in _trained_fields():
        option = "--" + f.name.replace("_", "-")
        # the annotation's first type (``from __future__`` leaves it a string)
        kind = _TYPES[str(f.type).split("|")[0].strip()]
        help = f.metadata["help"]
        if f.default is not None:  # a None default's help says what None means
            shown = str(f.default).lower() if kind is bool else f.default
            help += f" (default {shown})"
        group.add_argument(
            option,
            dest="train_" + f.name,
            type=_parse_bool(option) if kind is bool else kind,
            metavar=f.name.upper(),
            help=help,
        )


def train_overrides(args: argparse.Namespace) -> dict[str, object]:
    """The ``TrainConfig`` fields given on the command line (``add_train_arguments``)."""
    given = {f.name: getattr(args, "train_" + f.name) for f in _trained_fields()}
    return {name: value for name, value in given.items() if value is not None}
