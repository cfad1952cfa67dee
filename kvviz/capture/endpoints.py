"""The endpoints of a fleet's KV-event publishers as people give them (`--endpoint [NAME=]URL`,
`--replay [NAME=]URL`): for capture-vllm, kvviz monitor and the app's Live page alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import CaptureError

if TYPE_CHECKING:
    from .zmq_capture import Endpoint


def parse_sources(endpoints: list[str], replays: list[str] | None) -> list[Endpoint]:
    """--endpoint [NAME=]URL (repeatable) and --replay [NAME=]URL paired by name, or by order when
    unnamed; names default to replica-0, replica-1, ..."""
    from .dataset import check_name
    from .zmq_capture import Endpoint

    def split(value: str, flag: str, i: int) -> tuple[str | None, str]:
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            return None, value
        if not url:
            raise CaptureError(f"{flag} {value!r}: no address after {name}=")
        return check_name(name, flag), url

    named = [split(v, "--endpoint", i) for i, v in enumerate(endpoints)]
    names = [n or f"replica-{i}" for i, (n, _) in enumerate(named)]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise CaptureError(f"--endpoint: replica name {dup!r} is given twice")
    urls = [u for _, u in named]
    if dup := next((u for u in urls if urls.count(u) > 1), None):
        raise CaptureError(f"--endpoint: {dup} is given twice")
    replay_of: dict[str, str] = {}
    for i, v in enumerate(replays or []):
        name, url = split(v, "--replay", i)
        if name is None:
            if i >= len(names):
                raise CaptureError(f"--replay {v!r}: more replay endpoints than --endpoint")
            name = names[i]
        if name not in names:
            raise CaptureError(f"--replay {v!r}: no --endpoint is named {name!r} (known: {', '.join(names)})")
        if name in replay_of:
            raise CaptureError(f"--replay: replica {name!r} has two replay endpoints")
        replay_of[name] = url
    return [Endpoint(n, u, replay_of.get(n)) for n, u in zip(names, urls, strict=True)]
