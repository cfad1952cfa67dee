"""A recording run's attention rows as Parquet parts beside the store (STORE_FOLDER/attention/RUN_ID/).

The weights are most of a run's bytes. Inserted into DuckDB they were compressed again at every
checkpoint that found a partly filled row group, so they were held back and written at the run's end,
where the engine waited for them (about a second of a ten-second run). A Parquet part takes a row group
with every flush, compressed once, and a closed part is a complete file no later write touches: the
engine finds little left to write when it ends. The store's `attention` view reads the closed parts
where they lie (attention_parts names the runs that have them); the part being written is a hidden file
until it closes, every PART_SECONDS and at the run's end, so readers never see half a part.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from . import schema

PART_SECONDS = 10.0  # how long a part takes row groups before it is closed, and its rows readable
# The columns that take a dictionary and statistics: the key and weight lists gain nothing from either
# (floats and slots rarely repeat, and no query filters on them) and cost a third of a part's writing.
SCALARS = ["run_id", "step", "layer", "head", "request_id", "position"]
# Weights are float32 noise to a compressor (snappy saved 1.5% of a part for a fifth of its writing's CPU):
# only the scalar columns and the slots, which repeat, are compressed.
COMPRESSION = {"run_id": "snappy", "step": "snappy", "layer": "snappy", "head": "snappy", "request_id": "snappy",
               "position": "snappy", "key_slots": "snappy", "weights": "none", "key_classes": "snappy"}


class AttentionParts:
    """The parts of one run, written by the recorder's writer thread only."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.closed = 0  # parts closed so far
        self._writer: pq.ParquetWriter | None = None
        self._opened = 0.0

    def add(self, rows: pa.Table) -> None:
        """A row group of attention rows (as the store declares them)."""
        rows = schema.conform("attention", rows)
        if self._writer is None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self._hidden(), rows.schema, use_dictionary=SCALARS,
                                            write_statistics=SCALARS, compression=COMPRESSION)
            self._opened = time.monotonic()
        self._writer.write_table(rows, row_group_size=rows.num_rows)

    def due(self, force: bool) -> bool:
        """Is there an open part to close: PART_SECONDS old, or any with `force`?"""
        return self._writer is not None and (force or time.monotonic() - self._opened >= PART_SECONDS)

    def close(self) -> None:
        """The open part becomes a complete, readable file."""
        self._writer.close()
        self._writer = None
        os.replace(self._hidden(), self.folder / f"{self.closed:06d}.parquet")
        self.closed += 1

    def discard(self) -> None:
        """Stop writing (a failed write): the open part, never closed, stays hidden."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _hidden(self) -> Path:
        return self.folder / f".{self.closed:06d}.parquet.open"
