"""Model tooling: checkpoints in the Hugging Face layout (random-weight presets and
the trained doc-QA model), tokenizer training, doc-QA data and training. Not engine
code: the engine never imports it."""
