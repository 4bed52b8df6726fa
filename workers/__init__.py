"""The engine and the Ray worker actor. Offline use:
``from workers import LLM, ResponseFormat, SamplingParams``."""

from workers.engine.sampling_params import SamplingParams
from workers.engine.structured import ResponseFormat
from workers.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "ResponseFormat", "SamplingParams"]
