"""The /v1/chat/completions body and answer, as OpenAI's: messages in, an assistant message (or, streamed,
its deltas) out, with the chat shape of logprobs (`content`: per token its string, logprob, bytes and top
alternatives). The sampling fields and vLLM's extras are the completions body's (schema.SamplingFields)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from gpt2_jax.serving.schema import Int, SamplingFields, Usage


class TextPart(BaseModel):
    """A part of a message's content; text is the only kind a text model takes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(SamplingFields):
    """OpenAI's /v1/chat/completions body: messages (rendered to a prompt by the server's chat template), the
    sampling fields and extras /v1/completions takes, chat's logprobs (a flag and a count), and vLLM's
    add_generation_prompt (default true: the template ends on the assistant's turn)."""

    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: Int | None = None
    add_generation_prompt: bool | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatResponse(BaseModel):
    """A chat completion. Streamed, each server-sent event holds a chat.completion.chunk: the same, but each
    choice has a `delta` (the role first, then content) in place of `message`."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    seed: int
