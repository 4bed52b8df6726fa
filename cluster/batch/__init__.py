"""Batch jobs: OpenAI batch lines in, answers out, through the same completion service."""
