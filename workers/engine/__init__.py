"""The engine core: scheduler, reuse, KV pool, model runner, sampling, attention,
layers and models. Imports chunkstore only; nothing here knows about Ray."""
