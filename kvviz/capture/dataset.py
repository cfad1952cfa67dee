"""The capture dataset: Hive-partitioned Parquet that DuckDB, Spark and Trino read as one table.

    DIR/_kvviz_capture.json                  what was captured (replicas, endpoints, counts)
    DIR/replica=NAME/part-00000.parquet      one row per block of every event, ROW_SCHEMA less replica
    DIR/replica=NAME/_part-00001.parquet.inprogress  the part being written (a leading _ : DuckDB,
                                             Spark and Trino all skip it)

Rows are buffered per replica and written a row group at a time; a part is closed (renamed to
.parquet) every `rotate_rows` rows, so memory is bounded by the row group and a capture that is
killed loses at most the part in progress. docs/capture-format.md documents the columns.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import CaptureError
from .capture_file import Message
from .events import Batch
from .rows import CONTRACT_FIELDS, LIFE_FIELDS, ROW_SCHEMA, TENANT_FIELDS, EventRows

FILE_SCHEMA = ROW_SCHEMA.remove(ROW_SCHEMA.get_field_index("replica"))
MANIFEST = "_kvviz_capture.json"
FORMAT, VERSION = "kvviz-capture-dataset", 5
LATER = {name: typ for name, typ in (*LIFE_FIELDS, *TENANT_FIELDS, *CONTRACT_FIELDS)}  # columns versions 2, 3 and 5
# added: an older part reads them as null
# Page checksums: import verifies them, so corruption is said. Dictionaries only for the columns of few values:
# trying one for the hashes and payloads takes time and saves no bytes (docs/benchmarks.md).
PARQUET = {"compression": "zstd", "write_page_checksum": True,
           "use_dictionary": ["kind", "medium", "salt", "lora_name", "topic", "spec_kind", "locality", "session_id",
                              "restart", "rank", "event_index", "block_index", "block_size"]}
NAME = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")  # a replica name: a path part every engine reads as text


def check_name(name: str, flag: str = "--endpoint") -> str:
    if not NAME.fullmatch(name):
        raise CaptureError(f"{flag}: replica name {name!r} must start with a letter and hold only letters, digits, "
                           "'.', '_' or '-' (at most 64)")
    return name


@dataclass
class _ReplicaParts:
    folder: Path
    rows: EventRows = field(default_factory=EventRows)
    writer: pq.ParquetWriter | None = None
    part: int = 0
    in_part: int = 0

    def path(self) -> Path:
        return self.folder / f"part-{self.part:05d}.parquet"

    def in_progress(self) -> Path:
        return self.folder / f"_{self.path().name}.inprogress"

    def flush(self, rotate_rows: int) -> None:
        if not len(self.rows):
            return
        table = self.rows.take().drop_columns(["replica"])
        if self.writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.writer = pq.ParquetWriter(self.in_progress(), FILE_SCHEMA, **PARQUET)
        self.writer.write_table(table)
        self.in_part += table.num_rows
        if self.in_part >= rotate_rows:
            self.close_part()

    def close_part(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.in_progress().rename(self.path())
            self.writer, self.part, self.in_part = None, self.part + 1, 0


class DatasetWriter:
    """A capture sink writing the dataset from messages and their decoded batches. A `share` writer
    writes into a folder its caller made and leaves the manifest to it (`write_manifest`)."""

    def __init__(self, folder: str | Path, replicas: dict[str, str], rotate_rows: int = 1_000_000,
                 group_rows: int = 100_000, share: bool = False, given_as: str = "--out "):
        """`given_as` is how a refusal names the argument that gave `folder`."""
        self.folder, self.share = Path(folder), share
        if not share and self.folder.exists() and (not self.folder.is_dir() or any(self.folder.iterdir())):
            raise CaptureError(f"{given_as}{self.folder}: {'not a folder' if not self.folder.is_dir() else 'not empty'}"
                               "; give a new folder for the capture dataset")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.replicas, self.rotate_rows, self.group_rows = dict(replicas), rotate_rows, min(group_rows, rotate_rows)
        self.parts = {name: _ReplicaParts(self.folder / f"replica={name}") for name in replicas}
        self.first: dict[str, int] = {}  # replica -> the step of its first message
        self.count = 0
        self._manifest(complete=False)

    def add(self, m: Message, batch: Batch, where: str | None = None) -> None:
        """Buffer one message's rows; `where` is how an error in it names the message (by default its
        replica and sequence number)."""
        parts = self.parts.get(m.replica)
        if parts is None:  # a replica the capture's header did not name (a JSONL file being converted)
            self.replicas[m.replica] = ""
            parts = self.parts[m.replica] = _ReplicaParts(self.folder / f"replica={m.replica}")
        self.first.setdefault(m.replica, self.count)
        parts.rows.add(batch, step=self.count, replica=m.replica, restart=m.restart, seq=m.seq,
                       where=where or f"{m.replica} seq {m.seq}", received=m.received, topic=m.topic, payload=m.payload)
        self.count += 1
        if len(parts.rows) >= self.group_rows:
            parts.flush(self.rotate_rows)

    def close(self) -> None:
        for parts in self.parts.values():
            parts.flush(self.rotate_rows)
            parts.close_part()
        self._manifest(complete=True)

    def _manifest(self, complete: bool) -> None:
        if not self.share:
            write_manifest(self.folder, self.replicas, self.count, complete)


def write_manifest(folder: Path, replicas: dict[str, str], messages: int, complete: bool) -> None:
    """What a dataset holds; `complete` once every part is closed (import --in-place waits for it)."""
    (folder / MANIFEST).write_text(json.dumps({
        "format": FORMAT, "version": VERSION, "replicas": replicas, "messages": messages,
        "complete": complete, "written": time.time()}, indent=1) + "\n")


def dataset_files(path: Path) -> list[Path]:
    """The finished Parquet files of a dataset folder (or the one file given), sorted; what lies under
    a name starting with `_` (a part still being written, explain's answer in `_explained`) is not the
    capture's, as DuckDB, Spark and Trino skip it. A folder without any is refused, saying whether it
    is a capture that received nothing."""
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.parquet")  # a part or folder named _x is not the capture's
                   if p.is_file() and not any(part.startswith("_") for part in p.relative_to(path).parts))
    if not files:
        if (path / MANIFEST).is_file():
            raise CaptureError(f"{path}: the capture holds no messages (nothing was received, or it is still "
                               "writing its first parts)")
        raise CaptureError(f"{path}: not a capture dataset: no Parquet files (part-*.parquet) in it")
    return files


def check_files(files: list[Path]) -> None:
    """Every file is Parquet with the dataset's columns: a damaged file or another schema is refused,
    naming the file (damage inside the pages is found by their checksums as they are read)."""
    for f in files:
        try:
            with open(f, "rb") as head:
                if head.read(4) != b"PAR1":
                    raise CaptureError(f"{f}: not a Parquet file (it does not start with PAR1)")
            schema = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise CaptureError(f"{f}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
        missing = [n for n in FILE_SCHEMA.names if n not in schema.names and n not in LATER]
        wrong = [n for n in FILE_SCHEMA.names if n in schema.names
                 and not schema.field(n).type.equals(FILE_SCHEMA.field(n).type)]
        if missing or wrong:
            said = (f"lacks {', '.join(missing)}" if missing else "") + ("; " if missing and wrong else "") + (
                "has other types for " + ", ".join(f"{n} ({schema.field(n).type})" for n in wrong) if wrong else "")
            raise CaptureError(f"{f}: not a kvviz capture part: it {said}")
