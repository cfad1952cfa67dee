"""One user of an OpenAI-compatible server, as the timing audit sends its requests: a streamed
completion timed to its first token, with the usage the server reported (and llama.cpp's own count of
cached tokens where usage lacks one), and every way a server can fail the audit said in one sentence
that names what could not be measured."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import AuditError


@dataclass(frozen=True)
class Reply:
    ttft_ms: float
    # usage.prompt_tokens_details.cached_tokens, when the server reported it; else llama.cpp's own count
    # (llama-server's timings.cache_n: the prompt tokens its slot reused), when the stream carried that
    cached_tokens: int | None
    prompt_tokens: int | None  # usage.prompt_tokens, when the server reported usage at all


class Prober:
    """Sends prompts as one user (its API key and `user` field) and times the first token of a
    streamed reply."""

    def __init__(self, base_url: str, model: str, endpoint: str, key: str, user: str, timeout: float):
        import openai

        self.base_url, self.model, self.endpoint, self.user, self.timeout = base_url, model, endpoint, user, timeout
        self.client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout)
        self.answered = 0  # replies so far: a connection lost after one is the server's doing, not the URL's

    def send(self, prompt: str, max_tokens: int = 1) -> Reply:
        """Milliseconds to the first chunk that carries the reply (text or its end), and the cached and
        prompt tokens the server reported, if it did (cached: its usage's, else llama.cpp's timings)."""
        import openai

        first, cached, counted, own = None, None, None, None
        common = dict(model=self.model, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True}, user=self.user)
        t0 = time.perf_counter()
        try:
            if self.endpoint == "chat":
                stream = self.client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            else:
                stream = self.client.completions.create(prompt=prompt, **common)
            for chunk in stream:
                if first is None and chunk.choices and _carries_reply(chunk.choices[0], self.endpoint):
                    first = time.perf_counter()
                if chunk.usage is not None:
                    counted = chunk.usage.prompt_tokens
                    details = chunk.usage.prompt_tokens_details
                    if details is not None and details.cached_tokens is not None:
                        cached = details.cached_tokens
                own = n if (n := _cache_n(chunk)) is not None else own  # the last chunk's: the whole prompt's
        except openai.APITimeoutError:
            raise AuditError(f"{self.base_url} did not answer a request within {self.timeout:g} s (after "
                             f"{self.answered} replies to this user): a server this slow, or this busy, cannot be "
                             f"audited") from None
        except openai.APIConnectionError as e:
            if self.answered:
                raise AuditError(f"{self.base_url} closed the connection after {self.answered} replies to this "
                                 f"user: {e}") from None
            raise AuditError(f"cannot reach {self.base_url}: {e}") from None
        except openai.APIStatusError as e:
            if max_tokens > 1 and e.status_code in (400, 422):
                raise AuditError(f"{self.base_url} refused a primer asking for max_tokens {max_tokens} with HTTP "
                                 f"{e.status_code}: {_said(e)}; --primer-tokens 1 asks for one, though a server may "
                                 f"then cache nothing of the primer") from None
            raise AuditError(f"{self.base_url} refused a request with HTTP {e.status_code}: {_said(e)}") from None
        except (openai.APIError, ValueError) as e:  # a stream cut short, or not JSON
            raise AuditError(f"{self.base_url} broke off a reply: {e}") from None
        if first is None:
            raise AuditError(f"{self.base_url} streamed no reply to a request (asked with stream: true), so there "
                             f"is no time to first token to measure")
        self.answered += 1
        return Reply(ttft_ms=1000 * (first - t0), cached_tokens=cached if cached is not None else own,
                     prompt_tokens=counted)


def _cache_n(chunk) -> int | None:
    """llama.cpp's own count of the prompt tokens served from its cache, `timings.cache_n`, which
    llama-server puts on its last streamed chunk (on every chunk with timings_per_token) beside
    usage.prompt_tokens_details; read where a server sends it without that. None where the chunk
    carries no such field."""
    timings = (chunk.model_extra or {}).get("timings")
    n = timings.get("cache_n") if isinstance(timings, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def _said(e) -> str:
    """What the server said, without the client's "Error code: N - " and the body's wrapping; a 404
    that is not about the model is most likely a base URL without its /v1."""
    body = e.body
    said = str(((body.get("message") or body.get("detail")) if isinstance(body, dict) else body) or e.message)
    if e.status_code == 404 and "model" not in said.lower():
        said += " (is the base URL right? an OpenAI-compatible API's usually ends in /v1)"
    return said


def _carries_reply(choice, endpoint: str) -> bool:
    if choice.finish_reason is not None:
        return True
    return bool(choice.delta.content) if endpoint == "chat" else choice.text is not None
