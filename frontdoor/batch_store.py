"""The Batch API's durable state: metadata in SQLite (WAL), file contents under a data directory.

An embedded store, so that a single server needs no database to run and its jobs survive a
restart, a crash or a redeploy (the data directory is a volume or a PersistentVolumeClaim).
Every completed line of a batch is a row keyed by (batch, line number), inserted once: a line
is answered exactly once however often the server dies, because what is recorded is skipped on
resume and a line recorded twice is ignored. WAL with `synchronous=NORMAL` keeps every committed
transaction through a killed process (only an OS crash can lose the last ones, which then run
again). The output and error files are written from these rows when the batch finalizes.

Past one node this would be a shared database (PostgreSQL: the same tables, `INSERT ... ON
CONFLICT DO NOTHING`, a lease column so that one node runs each batch) and object storage for the
file contents (S3 or a shared volume); only this module would change.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MB = 10**6
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, output_file_id TEXT, error_file_id TEXT,
    errors TEXT, metadata TEXT, created_at INTEGER NOT NULL, in_progress_at INTEGER,
    expires_at INTEGER NOT NULL, finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER,
    expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    seq INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS batches_by_owner ON batches (owner, seq);
CREATE INDEX IF NOT EXISTS files_by_owner ON files (owner, created_at);
"""
BATCH_FIELDS = ("id", "endpoint", "input_file_id", "completion_window", "status", "output_file_id",
                "error_file_id", "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                "failed_at", "expired_at", "cancelling_at", "cancelled_at")


@dataclass(frozen=True)
class StoreLimits:
    """What one tenant may store and run. OpenAI's limits per file (200 MB, 50,000 requests); a
    few running batches per key, so that one tenant cannot queue the whole server's disk and
    time; and free space kept on the data volume, so that outputs and the database can still be
    written when an upload is accepted."""

    max_file_bytes: int = 200 * MB
    max_lines: int = 50_000
    max_active_batches: int = 8
    min_free_bytes: int = 1024 * MB


DATA_DIR_ENV = "BATCHSTRING_DATA_DIR"


def default_data_dir() -> Path:
    """BATCHSTRING_DATA_DIR (the image's volume), else the user's state directory (XDG), as other
    per-user services keep theirs."""
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV])
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "batchstring"


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class BatchStore:
    def __init__(self, data_dir: Path, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self.files_dir = data_dir / "files"
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(data_dir / "batchstring.db", isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.executescript(SCHEMA)
        except (OSError, sqlite3.Error) as exc:
            raise SystemExit(f"the Batch API cannot keep its data in {data_dir} ({exc}): give a writable directory "
                             f"(--data-dir, or {DATA_DIR_ENV}), or turn the OpenAI API off (--no-openai)") from None
        self.db.row_factory = sqlite3.Row
        self._sweep()

    def close(self) -> None:
        self.db.close()

    def _sweep(self) -> None:
        """Removes file contents no row names: uploads and outputs a crash left half written."""
        known = {row["id"] for row in self.db.execute("SELECT id FROM files")}
        for path in self.files_dir.iterdir():
            if path.name not in known:
                path.unlink(missing_ok=True)

    # ----- files -------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        return os.statvfs(self.files_dir).f_bavail * os.statvfs(self.files_dir).f_frsize

    def upload_path(self) -> Path:
        """Where an upload is written before it is accepted (swept away if the server dies)."""
        return self.files_dir / f".upload-{uuid.uuid4().hex}"

    def add_file(self, owner: str, filename: str, purpose: str, written: Path) -> dict:
        file_id = _new_id("file")
        size = written.stat().st_size
        os.replace(written, self.files_dir / file_id)
        self.db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                        (file_id, owner, filename, purpose, size, int(time.time())))
        return self.file(owner, file_id)

    def file(self, owner: str, file_id: str) -> dict | None:
        row = self.db.execute("SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)).fetchone()
        return _file_object(row) if row else None

    def files(self, owner: str, purpose: str | None, limit: int, after: str | None, ascending: bool) -> list[dict]:
        order = "ASC" if ascending else "DESC"
        anchor = self.db.execute("SELECT created_at, id FROM files WHERE id = ? AND owner = ?",
                                 (after, owner)).fetchone() if after else None
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose:
            query, args = query + " AND purpose = ?", [*args, purpose]
        if anchor:
            query += f" AND (created_at, id) {'>' if ascending else '<'} (?, ?)"
            args += [anchor["created_at"], anchor["id"]]
        rows = self.db.execute(f"{query} ORDER BY created_at {order}, id {order} LIMIT ?", (*args, limit))
        return [_file_object(row) for row in rows]

    def path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def delete_file(self, owner: str, file_id: str) -> bool:
        deleted = self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
        if deleted:
            self.path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # ----- batches -----------------------------------------------------------------------------

    def add_batch(self, owner: str, endpoint: str, input_file_id: str, window: str, window_seconds: int,
                  metadata: dict | None) -> sqlite3.Row:
        batch_id, now = _new_id("batch"), int(time.time())
        seq = self.db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
        self.db.execute(
            "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata, "
            "created_at, expires_at, seq) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
            (batch_id, owner, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None, now,
             now + window_seconds, seq))
        return self.batch_row(batch_id)

    def batch_row(self, batch_id: str, owner: str | None = None) -> sqlite3.Row | None:
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row if row and (owner is None or row["owner"] == owner) else None

    def batches(self, owner: str, limit: int, after: str | None) -> list[sqlite3.Row]:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        anchor = self.batch_row(after, owner) if after else None
        return self.db.execute("SELECT * FROM batches WHERE owner = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                               (owner, anchor["seq"] if anchor else 2**62, limit)).fetchall()

    def in_use(self, file_id: str) -> bool:
        """True while an unfinished batch reads the file (deleting it would fail the batch)."""
        marks = ",".join("?" * len(UNFINISHED))
        return self.db.execute(f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN ({marks})",
                               (file_id, *UNFINISHED)).fetchone() is not None

    def active_batches(self, owner: str) -> int:
        marks = ",".join("?" * len(UNFINISHED))
        return self.db.execute(f"SELECT COUNT(*) FROM batches WHERE owner = ? AND status IN ({marks})",
                               (owner, *UNFINISHED)).fetchone()[0]

    def unfinished(self) -> list[str]:
        marks = ",".join("?" * len(UNFINISHED))
        return [r["id"] for r in self.db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
                                                 UNFINISHED)]

    def update(self, batch_id: str, **fields) -> None:
        columns = ", ".join(f"{name} = ?" for name in fields)
        self.db.execute(f"UPDATE batches SET {columns} WHERE id = ?", (*fields.values(), batch_id))

    def set_status(self, batch_id: str, status: str, **fields) -> None:
        """A new status, stamped with its time (`in_progress_at`, `completed_at`, ...)."""
        self.update(batch_id, status=status, **{f"{status}_at": int(time.time())}, **fields)

    # ----- results -----------------------------------------------------------------------------

    def record(self, batch_id: str, lines: list[tuple[int, bool, str]]) -> None:
        """Answers for lines, in one transaction; a line already answered keeps its first answer."""
        with self._transaction():
            for ok in (True, False):
                rows = [(batch_id, line, int(ok), body) for line, good, body in lines if good == ok]
                added = self.db.executemany("INSERT OR IGNORE INTO results VALUES (?, ?, ?, ?)", rows).rowcount
                self.db.execute(f"UPDATE batches SET {'completed' if ok else 'failed'} = "
                                f"{'completed' if ok else 'failed'} + ? WHERE id = ?", (added, batch_id))

    def answered(self, batch_id: str) -> set[int]:
        return {r[0] for r in self.db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,))}

    def results(self, batch_id: str, ok: bool) -> Iterator[str]:
        rows = self.db.execute("SELECT body FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                               (batch_id, int(ok)))
        return (row[0] for row in rows)

    def finish(self, batch_id: str, owner: str, status: str, outputs: dict[str, Path]) -> None:
        """Makes the written output files part of the batch and ends it, in one transaction."""
        now = int(time.time())
        with self._transaction():
            ids = {}
            for column, written in outputs.items():
                ids[column] = _new_id("file")
                size = written.stat().st_size
                os.replace(written, self.files_dir / ids[column])
                self.db.execute("INSERT INTO files VALUES (?, ?, ?, 'batch_output', ?, ?)",
                                (ids[column], owner, f"{batch_id}_{column.removesuffix('_file_id')}.jsonl", size,
                                 now))
            self.set_status(batch_id, status, **ids)
            self.db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))

    def _transaction(self) -> _Transaction:
        return _Transaction(self.db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, *_) -> None:
        self.db.execute("ROLLBACK" if kind else "COMMIT")


def _file_object(row: sqlite3.Row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row: sqlite3.Row) -> dict:
    """The batch as OpenAI returns it."""
    return {**{name: row[name] for name in BATCH_FIELDS}, "object": "batch",
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}}
