"""Request and response bodies of ``/v1/chunks`` (the HTTP boundary).

Requests are strict and reject unknown fields: a misspelt ``ttl_s`` must not pin
a chunk forever.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.api.openai_protocol import ChatMessage


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class RegisterChunkRequest(_Strict):
    content: str | list[ChatMessage] = Field(
        description="the chunk: text (one message of the role's chat role) or chat messages"
    )
    role: Literal["system", "context", "query"] = Field(
        "context", description="system: a system message; context or query: a user message"
    )
    ttl_s: float | None = Field(
        None, gt=0, description="seconds until the chunk is unpinned; default: until DELETE"
    )
    replicas: int = Field(1, ge=1, description="workers that pin the chunk's KV")
    after: list[str] = Field(
        default_factory=list,
        description="ids of chunks that precede this one: its KV is computed after theirs",
    )
    mode: Literal["exact", "approximate"] = Field(
        "exact",
        description="exact: pin the KV of the chunk after its `after` chunks (reused by "
        "requests that start that way); approximate: pin one position-free copy of a "
        "context text, placed by approximate requests wherever it appears as a content "
        "part, after any system prompt (`after` must be empty)",
    )

    @model_validator(mode="after")
    def _check_content(self) -> RegisterChunkRequest:
        if isinstance(self.content, str) and not self.content.strip():
            raise ValueError("content must not be empty")
        if isinstance(self.content, list):
            if not self.content:
                raise ValueError("content must be a string or a non-empty list of messages")
            if any(m.chunk_ids for m in self.content):
                raise ValueError("a chunk's content cannot contain chunk parts")
        if self.mode == "approximate" and (
            self.after or self.role != "context" or not isinstance(self.content, str)
        ):
            raise ValueError(
                "an approximate chunk is a text of role context, position-free: "
                "`after` must be empty and `content` a string"
            )
        return self

    def content_for_registry(self) -> str | list[dict]:
        if isinstance(self.content, str):
            return self.content
        return [m.as_chunking_message() for m in self.content]


class Chunk(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str = Field(description="the chunk id (scoped to the caller's API key)")
    object: Literal["chunk"] = Field("chunk", description="object type")
    role: str = Field(description="system, context or query")
    tokens: int = Field(description="the chunk's own tokens")
    pinned_tokens: int = Field(description="tokens pinned per holder: full pages of its prefix")
    holders: list[str] = Field(description="workers holding the chunk pinned")
    expires_at: float | None = Field(description="Unix time its pin ends; null: until DELETE")
    hits: int = Field(0, description="requests served from its pinned pages, all holders")
    tokens_saved: int = Field(0, description="of its tokens, how many those hits reused")
    mode: Literal["exact", "approximate"] = Field(
        "exact", description="exact: pinned prefix pages; approximate: a position-free copy"
    )


class ChunkList(BaseModel):
    model_config = ConfigDict(frozen=True)

    object: Literal["list"] = Field("list", description="object type")
    data: list[Chunk] = Field(description="the caller's chunks")


class DeletedChunk(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str = Field(description="the deleted chunk's id")
    object: Literal["chunk"] = Field("chunk", description="object type")
    deleted: bool = Field(True, description="always true")
