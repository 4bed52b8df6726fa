"""The engine and the Ray worker actor. Offline use: ``from workers import LLM, SamplingParams``."""

from workers.llm import LLM, RequestOutput
from workers.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
