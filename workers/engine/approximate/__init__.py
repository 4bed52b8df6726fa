"""Approximate (position-independent) chunk reuse, in one package (docs/design.md,
"Approximate reuse"):

- ``chunk_reuse.ChunkReuse``: the reuse component the engine's reuse seam calls
  (``reuse.Reuse``): exact prefix reuse for every request, and for approximate ones
  position-free entries looked up, placed and repaired, and missed chunks' in-context
  KV taken as entries;
- ``placement``: moving a chunk's K/V to another position (keys re-rotated), into a
  request's pages (``place_spans``) and out of them into an entry (``take_spans``);
  which models' RoPE allows it;
- ``naive.NaivePlacement``: naive placement (no entry context, no repair), a
  measurement mode never offered to users.

The device side lives with the parts that own it: the selection and kept-row graphs
in ``graphs/`` (the runner's), the placement and scattered-attention kernels in
``layers/``, entry fills (an internal sequence) in ``engine.py``.
"""
