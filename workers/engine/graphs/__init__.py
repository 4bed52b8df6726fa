"""The CUDA graphs the model runner captures and replays: decode, cascade and prefill
steps (``step``), the approximate admission's selection pass and kept rows. They drive
an attention backend through its plan hooks; no backend imports this package."""
