"""Where the Batch API keeps file contents (uploads and outputs): a directory or PostgreSQL.

One node keeps them as files under its data directory (`LocalFiles`). Several replicas behind one
address keep them where every replica reaches: in the same PostgreSQL database as the batches
(`PostgresFiles`, parts of 1 MiB in a table), written in the transaction that records the file, so
that a file row never names contents that are not there. Both read a file as a buffered binary
stream from any byte offset: the runner reads a chunk of lines from where it starts, a download
streams the whole.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import BinaryIO, Protocol

PART_BYTES = 2**20


class FileStore(Protocol):
    def put(self, file_id: str, source: Path, db) -> int:
        """Stores `source`'s bytes as `file_id` (inside the caller's transaction `db`); its size."""

    def open(self, file_id: str, offset: int = 0) -> BinaryIO:
        """The contents from `offset`, buffered (iterating yields lines)."""

    def delete(self, file_id: str, db) -> None: ...

    def sweep(self, known: set[str], db) -> None:
        """Removes contents no file row names (an upload or output a crash left half stored)."""


class LocalFiles:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    def put(self, file_id: str, source: Path, db=None) -> int:
        size = source.stat().st_size
        os.replace(source, self.path(file_id))
        return size

    def open(self, file_id: str, offset: int = 0) -> BinaryIO:
        f = self.path(file_id).open("rb")
        f.seek(offset)
        return f

    def delete(self, file_id: str, db=None) -> None:
        self.path(file_id).unlink(missing_ok=True)

    def sweep(self, known: set[str], db=None) -> None:
        for path in self.directory.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)


class PostgresFiles:
    """File contents as rows of `file_parts` (file_id, part, data); `db` is the store's database."""

    SCHEMA = """CREATE TABLE IF NOT EXISTS file_parts (
        file_id TEXT NOT NULL, part INTEGER NOT NULL, data BYTEA NOT NULL, PRIMARY KEY (file_id, part))"""

    def __init__(self, db) -> None:
        self.db = db
        db.execute(self.SCHEMA)

    def put(self, file_id: str, source: Path, db) -> int:
        size = 0
        with source.open("rb") as f:
            for part, data in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
                db.execute("INSERT INTO file_parts VALUES (?, ?, ?)", (file_id, part, data))
                size += len(data)
        source.unlink()
        return size

    def open(self, file_id: str, offset: int = 0) -> BinaryIO:
        return io.BufferedReader(_Parts(self.db, file_id, offset), buffer_size=PART_BYTES)

    def delete(self, file_id: str, db) -> None:
        db.execute("DELETE FROM file_parts WHERE file_id = ?", (file_id,))

    def sweep(self, known: set[str], db) -> None:
        db.execute("DELETE FROM file_parts WHERE file_id NOT IN (SELECT id FROM files)")


class _Parts(io.RawIOBase):
    """A file's parts read one at a time, from a byte offset."""

    def __init__(self, db, file_id: str, offset: int) -> None:
        self.db, self.file_id = db, file_id
        self.part, self.skip = divmod(offset, PART_BYTES)
        self.pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self.pending:
            row = self.db.execute("SELECT data FROM file_parts WHERE file_id = ? AND part = ?",
                                  (self.file_id, self.part)).fetchone()
            if row is None:
                return 0
            self.pending, self.skip = bytes(row["data"])[self.skip :], 0
            self.part += 1
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n
