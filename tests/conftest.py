"""Suite-wide settings: every process a test starts prints its threads' stacks when it is stopped at a
deadline, and under pytest-xdist each worker has a model line of its own.

The line (kvviz/models/queue.py) is machine-wide by design: runs on one model take turns across
processes. Two workers running tests at once are not two users sharing a model, and a test that
counts the runs ahead of it must not see the other worker's; so each worker gets a cache folder
whose converted weights and downloads are the shared cache's (links) and whose line is its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# A child process (the CLI, a server, the Streamlit app) sent SIGABRT at a test's deadline prints
# every thread's stack before it dies (tests/cli.py, tests/browser.py).
os.environ["PYTHONFAULTHANDLER"] = "1"
_OWN_CACHE = pytest.StashKey[Path]()


def _own_model_line(worker: str) -> Path:
    from kvviz.models.cache import cache_dir

    shared = cache_dir()
    own = Path(tempfile.mkdtemp(prefix=f"kvviz-{worker}-"))
    for sub in ("models", "converted"):
        (shared / sub).mkdir(parents=True, exist_ok=True)
        (own / sub).symlink_to(shared / sub, target_is_directory=True)
    return own


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        own = _own_model_line(worker)
        config.stash[_OWN_CACHE] = own
        os.environ["KVVIZ_CACHE"] = str(own)
        import torch

        torch.set_num_threads(1)  # two workers on two cores: a second thread each would only contend


def pytest_unconfigure(config: pytest.Config) -> None:
    own = config.stash.get(_OWN_CACHE, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)  # the links only: rmtree does not follow them


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `published` (the timing audit at the published size, about 17 minutes) run only
    when the marker expression names them: `python -m pytest -m published`."""
    if "published" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="the published-size audit: run it with -m published")
    for item in items:
        if "published" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def spark():
    """One local Spark session per worker for the spark-marked tests (starting its JVM takes 10-20 s);
    skipped, saying why, where pyspark or Java is missing."""
    pytest.importorskip("pyspark", reason="pyspark is not installed (pip install pyspark, see requirements.txt)")
    if shutil.which("java") is None:
        pytest.skip("java is not installed: Spark needs a JRE (Debian: openjdk-17-jre-headless)")
    from pyspark.sql import SparkSession

    session = (SparkSession.builder.master("local[1]").appName("kvviz-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "512m").config("spark.sql.session.timeZone", "UTC")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
