"""The OpenAI request bodies kvviz serves, validated field by field, and the error body clients expect.

Unknown fields are ignored, as OpenAI-compatible servers do (clients send options kvviz has no use
for); fields kvviz cannot honour (n > 1, logprobs, tools) are refused with the field named.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _refused(message: str):
    """A validator refusing any value but the default (a feature kvviz does not serve)."""
    def check(cls, v):
        if v:
            raise ValueError(message)
        return v
    return classmethod(check)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="kvviz returns one choice")
    user: str | None = None
    cache_salt: str | None = Field(None, min_length=1)
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty stop strings")
        return stops

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

    _no_logprobs = field_validator("logprobs")(_refused("kvviz does not return logprobs"))
    _no_echo = field_validator("echo")(_refused("kvviz does not echo the prompt"))


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as text: a string, or the text parts of a list (other parts are refused)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, "only text content parts are supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None

    _no_logprobs = field_validator("logprobs")(_refused("kvviz does not return logprobs"))
    _no_tools = field_validator("tools")(_refused("kvviz does not call tools"))


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI's validation errors as one sentence and the offending field (OpenAI's `param`)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        why = (first.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON{f' ({why})' if why else ''}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    return (f"{param}: {msg}" if param else msg), param
