"""A kvviz server inside this process, on a thread and a free local port: what the app's Audit page
audits when the user has no server of their own, and what the tests talk to."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from ..engine import EngineConfig, StepRecord
from ..models import LoadedModel
from ..store import RunStore
from .app import ServeOptions, create_app
from .worker import EngineWorker


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """Started on construction (returns once it listens); `close` drains and stops it. Use as a
    context manager. `url` is the server's root; the OpenAI API is under url + "/v1"."""

    def __init__(self, model: LoadedModel, config: EngineConfig, options: ServeOptions, max_in_flight: int = 64,
                 oracle: bool = False, fault: str | None = None, record: RunStore | None = None,
                 on_step: Callable[[StepRecord], None] | None = None):
        self.worker = EngineWorker(model, config, max_in_flight, oracle, fault, record, on_step)
        self.url = f"http://127.0.0.1:{free_port()}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.worker, options), host="127.0.0.1",
                                                    port=int(self.url.rsplit(":", 1)[1]), log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="kvviz-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.worker.close()
                raise RuntimeError("the local kvviz server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.close()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
