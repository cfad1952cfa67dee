"""Helpers for real-browser tests: run the Streamlit app, drive it with Playwright + Debian chromium.

Not a test module. Typical use (see tests/test_browser.py):

    pytestmark = [pytest.mark.browser, pytest.mark.skipif(bool(SKIP_REASON), reason=SKIP_REASON or "")]

    with streamlit_app(tmp_path / "kvviz.duckdb") as url, chromium() as browser:
        page = new_page(browser)
        page.goto(url)
        wait_for_app(page)
        shot(page, "home")

Playwright's own browser download cannot work here: chromium comes from apt (/usr/bin/chromium).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
# Without the networking flags Chromium keeps trying hosts it cannot reach.
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
VIEWPORT = {"width": 1400, "height": 900}
APP_TIMEOUT_MS = 60_000


def _skip_reason() -> str | None:
    if not Path(CHROMIUM).exists():
        return f"{CHROMIUM} missing (install Debian chromium: apt-get install -y chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright not installed (pip install -r requirements.txt)"
    return None


# None when browser tests can run; otherwise why not (for pytest.mark.skipif).
SKIP_REASON: str | None = _skip_reason()


def free_port() -> int:
    """A localhost TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> str | None:
    # No proxies: an http_proxy in the environment must not intercept localhost polls.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as r:
            return r.read().decode("utf-8", "replace").strip()
    except (urllib.error.URLError, OSError):
        return None


def _tail(log: IO[bytes], limit: int = 8000) -> str:
    log.flush()
    log.seek(0)
    return log.read().decode("utf-8", "replace")[-limit:]


def _stacks(proc: subprocess.Popen, log: IO[bytes]) -> str:
    """Every thread's stack of a running app (PYTHONFAULTHANDLER, set by conftest.py, prints them on
    SIGABRT, which ends it), then its output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return _tail(log, 40_000)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@contextmanager
def streamlit_app(db_path: str | os.PathLike, *, timeout: float = 60.0, app: str = "app.py",
                  env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `streamlit run app.py` from the repo root with KVVIZ_DB=db_path; yield its base URL.

    Waits until /_stcore/health answers "ok" (at most `timeout` seconds); fails with the server's
    output if it exits first. Terminates (then kills) the server on exit. `env` adds variables.
    """
    full_env = {**os.environ, "KVVIZ_DB": str(db_path), **(env or {})}
    for attempt in range(3):  # free_port() can race with another process; retry on a new port
        port = free_port()
        cmd = [sys.executable, "-m", "streamlit", "run", app,
               "--server.headless", "true", "--server.port", str(port), "--server.address", "127.0.0.1",
               "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"]  # no polling of sources
        log = tempfile.TemporaryFile()
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    out = _tail(log)
                    if "already in use" in out and attempt < 2:
                        break
                    raise RuntimeError(f"streamlit exited with code {proc.returncode} before it was "
                                       f"healthy:\n{out}")
                if _health(f"{base}/_stcore/health") == "ok":
                    try:
                        yield base
                    except BaseException:  # the test failed or hit its deadline: what was the app doing?
                        print(f"streamlit's stacks and output when the test failed:\n{_stacks(proc, log)}",
                              file=sys.stderr)
                        raise
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"streamlit not healthy on {base} after {timeout:.0f} s:\n{_tail(log)}")
                time.sleep(0.2)
        finally:
            _stop(proc)
            log.close()
    raise RuntimeError("streamlit could not get a free port in 3 attempts")


@contextmanager
def chromium(*, headless_args: tuple[str, ...] = CHROMIUM_ARGS) -> Iterator[Browser]:
    """Playwright's chromium driven on the Debian binary (/usr/bin/chromium); closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = launch_chromium(pw, args=headless_args)
        try:
            yield browser
        finally:
            browser.close()


def launch_chromium(pw, *, args: tuple[str, ...] = CHROMIUM_ARGS) -> Browser:
    """Launch chromium from an already started `sync_playwright()` object."""
    return pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(args))


def new_page(browser: Browser, *, timeout_ms: int = APP_TIMEOUT_MS) -> Page:
    """A page in a fresh context with a desktop viewport and generous default timeouts."""
    page = browser.new_context(viewport=VIEWPORT).new_page()
    page.set_default_timeout(timeout_ms)
    return page


def wait_for_app(page: Page, *, timeout_ms: int = APP_TIMEOUT_MS) -> None:
    """Wait until the Streamlit app is mounted and its script has finished a run.

    Before the first run the stApp element says data-test-script-state="initial", so "notRunning"
    means a run has completed. Call again after an interaction that reruns the script (after the
    rerun has started).
    """
    page.wait_for_selector('[data-testid="stApp"]', timeout=timeout_ms)
    page.wait_for_selector('[data-testid="stApp"][data-test-script-state="notRunning"]', timeout=timeout_ms)


def artifacts_dir() -> Path:
    """$KVVIZ_ARTIFACTS if set, else runs/screenshots/ (git-ignored via runs/.gitignore); created."""
    d = Path(os.environ["KVVIZ_ARTIFACTS"]) if os.environ.get("KVVIZ_ARTIFACTS") else REPO / "runs" / "screenshots"
    d.mkdir(parents=True, exist_ok=True)
    return d


def shot(page: Page, name: str) -> Path:
    """Save a full-page PNG screenshot as <artifacts>/<name>.png and return its path."""
    path = artifacts_dir() / (name if name.endswith(".png") else f"{name}.png")
    page.screenshot(path=str(path), full_page=True)
    return path
