"""Checkpoint directory helpers: tokenizer loading and a content fingerprint."""

from __future__ import annotations

import hashlib
from pathlib import Path

_SAMPLE_BYTES = 1 << 16


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"cannot load the tokenizer from {str(model_dir)!r}: {e}") from e


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """A short id of the checkpoint's contents, equal across machines for the same
    files: config plus, per weight file, its size and bytes sampled from its middle
    and end (so two random checkpoints of one shape differ)."""
    path = Path(model_dir)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        h.update(file.name.encode())
        h.update(size.to_bytes(8, "little"))
        with file.open("rb") as f:
            for offset in (size // 2, max(0, size - _SAMPLE_BYTES)):
                f.seek(offset)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:16]
