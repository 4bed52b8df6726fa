"""Chunk keys, request chunking and the chunk directory.

This package imports nothing else from the project: workers and cluster both
depend on it, never the other way round.
"""
