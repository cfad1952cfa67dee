"""`kvviz serve`'s HTTP face: OpenAI's completions and chat completions (streamed as server-sent
events or not), models, health, Prometheus metrics and vLLM's reset of the prefix cache, over one
EngineWorker.

Cache sharing, as an operator would set it: `global` shares the prefix cache across everyone;
`per-user` namespaces each request by its `user` field or API key (a request's own `cache_salt`, as
vLLM accepts it, always wins); `off` runs without prefix caching.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from ..errors import WorkloadError
from .metrics import exposition
from .protocol import ApiError, ChatRequest, CompletionRequest, validation_message
from .worker import Delta, Done, EngineWorker, Failed, QueueFull, ShuttingDown, Submission


@dataclass(frozen=True)
class ServeOptions:
    model_name: str  # what clients put in `model`
    cache_sharing: str = "global"
    completion_tokens: int = 16  # max_tokens when a completion request gives none (OpenAI's default)
    chat_tokens: int = 256  # and a chat request
    chat_template: str | None = None  # Jinja, for a model whose tokenizer has none


def salt(body, api_key: str | None, sharing: str) -> str | None:
    """The request's prefix-cache namespace under the server's sharing policy."""
    if body.cache_salt:
        return body.cache_salt
    if sharing != "per-user":
        return None
    if body.user:
        return f"user:{body.user}"
    return f"key:{hashlib.sha256(api_key.encode()).hexdigest()[:16]}" if api_key else None


def create_app(worker: EngineWorker, options: ServeOptions,
               on_stop: Callable[[EngineWorker], None] | None = None) -> FastAPI:
    """The app over a running worker; at shutdown (after uvicorn has drained the requests in flight)
    the worker stops and on_stop hears it."""

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        worker.close()
        if on_stop is not None:
            on_stop(worker)

    app = FastAPI(title="kvviz serve", version="1", lifespan=lifespan)
    tok = worker.model.tokenizer

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(e.errors())
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:  # a bug of kvviz's: still an OpenAI body
        return JSONResponse(ApiError(500, f"{type(e).__name__}: {e}", "server_error").body(), status_code=500)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind).body(), status_code=e.status_code)

    @app.get("/health")
    async def health() -> Response:
        if worker.error is not None:
            return JSONResponse({"status": "failed", "error": worker.error}, status_code=503)
        return JSONResponse({"status": "ok", "in_flight": worker.in_flight()})

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                            "owned_by": "kvviz", "max_model_len": worker.engine.config.num_blocks
                                            * worker.engine.config.block_size}]}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = exposition(worker)
        return Response(body, media_type=content_type)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        """vLLM's endpoint: forget every cached block, once no request runs (409 while any does)."""
        try:
            reset = await asyncio.wrap_future(worker.reset_prefix_cache())
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error") from None
        if not reset:
            raise ApiError(409, f"the prefix cache is reset only when no request runs ({worker.in_flight()} in "
                                "flight); try again when the server is idle", "conflict_error")
        return JSONResponse({"reset": True})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, "kvviz takes one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = tok(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        return await _serve(body, request, ids, body.limit(options.completion_tokens), "text_completion", "cmpl")

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        if not (options.chat_template or getattr(tok, "chat_template", None)):
            raise ApiError(400, f"the model {options.model_name} has no chat template; start the server with "
                                "--chat-template FILE or use /v1/completions", param="messages")
        messages = [{"role": model.role, "content": model.text()} for model in body.messages]
        try:
            ids = tok.apply_chat_template(messages, chat_template=options.chat_template, add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
        except Exception as e:  # noqa: BLE001 (a template's own error: the client's messages do not fit it)
            raise ApiError(400, f"the chat template refused these messages: {e}", param="messages") from None
        return await _serve(body, request, list(ids), body.limit(options.chat_tokens), "chat.completion", "chatcmpl")

    async def _serve(body, request: Request, ids: list[int], limit: int, kind: str, prefix: str) -> Response:
        if body.model != options.model_name:
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {options.model_name!r}",
                           "not_found_error", "model", "model_not_found")
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip() or None
        sub = Submission(ids, limit, body.temperature, body.top_p, body.seed, salt(body, key, options.cache_sharing),
                         tuple(body.stop or ()), body.ignore_eos)
        try:
            worker.check(sub)
            rid, events = worker.submit(sub)
        except WorkloadError as e:
            why = str(e).replace("requests[0]", "this request").replace("raise engine.num_blocks",
                                                                         "the server's --num-blocks is too small")
            raise ApiError(400, why, param="max_tokens") from None
        except QueueFull as e:
            raise ApiError(429, str(e), "rate_limit_error") from None
        except ShuttingDown as e:
            raise ApiError(503, str(e), "server_error") from None
        reply = _Reply(f"{prefix}-{rid}", kind, options.model_name)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(worker, rid, events, reply, usage), media_type="text/event-stream")
        text = []
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                text.append(event.text)
            elif isinstance(event, Failed):
                raise ApiError(500, event.message, "server_error")
            else:
                return JSONResponse(reply.whole("".join(text), event))

    return app


@dataclass(frozen=True)
class _Reply:
    """One response's id and shape (completion or chat), streamed or whole."""

    id: str
    kind: str  # text_completion | chat.completion
    model: str

    @property
    def chat(self) -> bool:
        return self.kind == "chat.completion"

    def _frame(self, choices: list, chunk: bool) -> dict:
        kind = "chat.completion.chunk" if self.chat and chunk else self.kind
        return {"id": self.id, "object": kind, "created": int(time.time()), "model": self.model, "choices": choices}

    def choice(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        delta = ({"role": "assistant", "content": ""} if first else {}) | ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def whole(self, text: str, done: Done) -> dict:
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": done.finish_reason} if self.chat else
                  {"index": 0, "text": text, "logprobs": None, "finish_reason": done.finish_reason})
        return self._frame([choice], chunk=False) | {"usage": usage(done)}

    def chunk(self, choice: dict | None, done: Done | None = None) -> str:
        frame = self._frame([choice] if choice else [], chunk=True)
        if done is not None:
            frame["usage"] = usage(done)
        return f"data: {json.dumps(frame)}\n\n"


def usage(done: Done) -> dict:
    """Token counts as vLLM reports them: cached_tokens are prompt tokens the prefix cache served."""
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


async def _stream(worker: EngineWorker, rid: str, events, reply: _Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the text as generated, the finish reason, the usage if asked, [DONE]. A
    client that goes away cancels its request, which frees its blocks."""
    finished = False
    try:
        if reply.chat:
            yield reply.chunk(reply.choice(None, None, first=True))
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                yield reply.chunk(reply.choice(event.text, None))
                continue
            finished = True
            if isinstance(event, Failed):
                yield f"data: {json.dumps(ApiError(500, event.message, 'server_error').body())}\n\n"
                return
            yield reply.chunk(reply.choice(None, event.finish_reason))
            if include_usage:
                yield reply.chunk(None, event)
            yield "data: [DONE]\n\n"
            return
    finally:
        if not finished:
            worker.cancel(rid)
