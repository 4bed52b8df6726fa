"""A small byte-level BPE tokenizer, trained on the corpus the project ships, saved in
the Hugging Face layout with the chat template of a model family.

Invariants:
- Training is deterministic: the same family and vocab size give byte-identical files.
- The family's special tokens take ids 0..k-1, in the order of ``ChatFamily.special_tokens``.
- Encoding adds no special tokens (there is no BOS post-processor); the chat templates
  write every control token explicitly, so tokenizing a chunk on its own never depends
  on the chunks around it.
- Message content is a string or a list of ``{"type": "text", "text": ...}`` parts; the
  parts are concatenated with nothing in between.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
DEFAULT_VOCAB_SIZE = 1024

# Renders a message's content: a string as is, a list of text parts concatenated.
_CONTENT_MACRO = (
    "{%- macro render_content(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part['type'] != 'text' -%}"
    "{{ raise_exception('only content parts of type text are supported') }}"
    "{%- endif -%}{{ part['text'] }}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

CHATML_TEMPLATE = _CONTENT_MACRO + (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{{ render_content(message['content']) }}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

LLAMA3_TEMPLATE = _CONTENT_MACRO + (
    "{{ '<|begin_of_text|>' }}"
    "{%- for message in messages -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{ render_content(message['content']) }}"
    "{{ '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif -%}"
)


@dataclass(frozen=True)
class ChatFamily:
    """Special tokens and chat format of one model family."""

    special_tokens: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str
    stop_tokens: tuple[str, ...]  # every token that ends generation; eos first
    chat_template: str


FAMILIES: dict[str, ChatFamily] = {
    "qwen3": ChatFamily(
        special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        chat_template=CHATML_TEMPLATE,
    ),
    "llama": ChatFamily(
        special_tokens=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        stop_tokens=("<|eot_id|>", "<|end_of_text|>"),
        chat_template=LLAMA3_TEMPLATE,
    ),
}


def chat_family(family: str) -> ChatFamily:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def train_bpe(
    special_tokens: tuple[str, ...],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    extra_texts: Sequence[str] = (),
) -> Tokenizer:
    """Byte-level BPE over the shipped corpus plus ``extra_texts`` (in order);
    ``vocab_size`` counts the special tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(special_tokens):
        raise ValueError(
            f"vocab_size {vocab_size} is too small: the byte alphabet and special tokens "
            f"alone need {len(alphabet) + len(special_tokens)}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    corpus = [CORPUS_PATH.read_text(encoding="utf-8"), *extra_texts]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    return tokenizer


def build_tokenizer(
    family: str = "qwen3",
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    extra_texts: Sequence[str] = (),
) -> PreTrainedTokenizerFast:
    """The family's tokenizer; ``extra_texts`` are trained on after the shipped corpus
    (the doc-QA model passes its generated conversations)."""
    spec = chat_family(family)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_bpe(spec.special_tokens, vocab_size, extra_texts),
        bos_token=spec.bos,
        eos_token=spec.eos,
        pad_token=spec.pad,
        additional_special_tokens=[
            t for t in spec.special_tokens if t not in (spec.bos, spec.eos, spec.pad)
        ],
    )
    tokenizer.chat_template = spec.chat_template
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> list[Path]:
    """Writes tokenizer.json, tokenizer_config.json (chat template inside) and
    special_tokens_map.json, readable by transformers 4.x and 5.x alike."""
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    # transformers 5 writes its own backend class and a list under "extra_special_tokens";
    # 4.x resolves neither, while 5.x reads these 4.x names too.
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["additional_special_tokens"] = config.pop("extra_special_tokens", [])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_map = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "additional_special_tokens": [
            t
            for t in tokenizer.all_special_tokens
            if t not in tokenizer.special_tokens_map.values()
        ],
    }
    special_path = out_dir / "special_tokens_map.json"
    special_path.write_text(json.dumps(special_map, indent=2, sort_keys=True) + "\n")
    return [out_dir / "tokenizer.json", config_path, special_path]
