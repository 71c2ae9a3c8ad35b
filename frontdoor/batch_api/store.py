"""The Batch API's durable state, in SQLite (one node) or PostgreSQL (replicas behind one address).

One node keeps its metadata in SQLite (WAL) and file contents under its data directory, so that a
single server needs no database to run and its jobs survive a restart, a crash or a redeploy.
Replicas share one PostgreSQL database, chosen by URL (`--batch-store postgresql://...`), holding
the same tables and the file contents too (frontdoor/batch_api/files.py): whichever replica a balancer
picks reads and writes the same batches and files.

Exactly once, by the database: every answered line is a row keyed by (batch, line), inserted with
`ON CONFLICT DO NOTHING` in the transaction that counts it, after the batch's row is locked and
found unfinished; a batch ends in one transaction that locks its row, writes its outputs from
those rows and sets its final status, once. Nothing about it depends on timing.

Who works, by leases: a batch's requests are cut into chunks at validation; a replica claims a
chunk (or a batch to validate) by writing its name and an expiry into the row, renews its leases
while it works, and releases them when it stops. A chunk whose lease lapsed (its replica died or
hung) is claimed by another, which skips the lines already answered. Lease times are the
replicas' clocks (time.time()): a skewed clock can only make two replicas work on a chunk at once,
which the (batch, line) key absorbs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from batchstring.frontdoor.batch_api.files import FileStore, LocalFiles, PostgresFiles

MB = 10**6
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
FINAL = ("completed", "failed", "cancelled", "expired")
STORE_ENV = "BATCHSTRING_BATCH_STORE"  # the store's URL where a URL would carry a secret

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL,
    bytes {int} NOT NULL, created_at {int} NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL, status TEXT NOT NULL, output_file_id TEXT, error_file_id TEXT,
    errors TEXT, metadata TEXT, created_at {int} NOT NULL, in_progress_at {int},
    expires_at {int} NOT NULL, finalizing_at {int}, completed_at {int}, failed_at {int},
    expired_at {int}, cancelling_at {int}, cancelled_at {int},
    total {int} NOT NULL DEFAULT 0, completed {int} NOT NULL DEFAULT 0, failed {int} NOT NULL DEFAULT 0,
    seq {int} NOT NULL, lease_owner TEXT, lease_expires {real});
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line {int} NOT NULL, ok INTEGER NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (batch_id, line)) {rowid};
CREATE TABLE IF NOT EXISTS chunks (
    batch_id TEXT NOT NULL, chunk INTEGER NOT NULL, first_line {int} NOT NULL, start_offset {int} NOT NULL,
    lines INTEGER NOT NULL, owner TEXT, expires {real}, done INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, chunk)) {rowid};
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


@dataclass(frozen=True)
class Chunk:
    """A run of a batch's requests: `lines` requests from the one on file line `first_line`, which
    starts at byte `start_offset` of the input file."""

    batch_id: str
    chunk: int
    first_line: int
    start_offset: int
    lines: int


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


# ----- the two databases ---------------------------------------------------------------------------


class Result:
    """A statement's rows, all fetched while the connection's lock was held: SQLite refuses to
    commit while another thread is still stepping through a statement's rows."""

    def __init__(self, rows: list, rowcount: int) -> None:
        self.rows, self.rowcount = rows, rowcount

    def fetchone(self):
        return self.rows[0] if self.rows else None

    def fetchall(self) -> list:
        return self.rows

    def __iter__(self):
        return iter(self.rows)


class Database:
    """One connection, shared by the event loop and worker threads under a lock; SQL written with
    `?` placeholders; every statement's rows fetched before the lock is let go. `shared`: other
    replicas use it too (leases matter)."""

    shared = False
    skip_locked = ""  # the claim queries' row locking, where the database has it

    def __init__(self) -> None:
        self.lock = threading.RLock()

    def execute(self, sql: str, args: tuple = ()) -> Result:
        raise NotImplementedError

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        raise NotImplementedError

    def next_seq(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class SQLiteDatabase(Database):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.connection = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.connection.execute("PRAGMA journal_mode=WAL")
        self.connection.execute("PRAGMA synchronous=NORMAL")
        self.connection.executescript(SCHEMA.format(int="INTEGER", real="REAL", rowid="WITHOUT ROWID"))
        self.connection.row_factory = sqlite3.Row
        columns = {row["name"] for row in self.connection.execute("PRAGMA table_info(batches)")}
        for name, kind in (("lease_owner", "TEXT"), ("lease_expires", "REAL")):  # a store made before leases
            if name not in columns:
                self.connection.execute(f"ALTER TABLE batches ADD COLUMN {name} {kind}")

    def execute(self, sql: str, args: tuple = ()) -> Result:
        with self.lock:
            cursor = self.connection.execute(sql, args)
            return Result(cursor.fetchall(), cursor.rowcount)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        with self.lock:
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                yield self
                self.connection.execute("COMMIT")
            except BaseException:
                if self.connection.in_transaction:
                    self.connection.execute("ROLLBACK")
                raise

    def next_seq(self) -> int:
        return self.execute("SELECT COALESCE(MAX(seq), 0) + 1 AS seq FROM batches").fetchone()["seq"]

    def close(self) -> None:
        self.connection.close()


class PostgresDatabase(Database):
    shared = True
    skip_locked = "FOR UPDATE SKIP LOCKED"

    def __init__(self, url: str) -> None:
        super().__init__()
        import psycopg
        from psycopg.rows import dict_row

        self.psycopg, self.url, self.row_factory = psycopg, url, dict_row
        self.connection = self._connect()
        self._in_transaction = False
        with self.transaction():
            self.connection.execute("SELECT pg_advisory_xact_lock(7243)")  # replicas starting together
            for statement in filter(str.strip, SCHEMA.format(int="BIGINT", real="DOUBLE PRECISION", rowid="")
                                    .split(";")):
                self.connection.execute(statement)
            self.connection.execute("CREATE SEQUENCE IF NOT EXISTS batch_seq")

    def _connect(self):
        return self.psycopg.connect(self.url, autocommit=True, row_factory=self.row_factory)

    def execute(self, sql: str, args: tuple = ()) -> Result:
        with self.lock:
            try:
                cursor = self.connection.execute(sql.replace("?", "%s"), args)
            except self.psycopg.OperationalError:
                if self._in_transaction or not self.connection.closed:
                    raise
                self.connection = self._connect()  # the server restarted: once more on a new connection
                cursor = self.connection.execute(sql.replace("?", "%s"), args)
            return Result(cursor.fetchall() if cursor.description else [], cursor.rowcount)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        with self.lock, self.connection.transaction():
            self._in_transaction = True
            try:
                yield self
            finally:
                self._in_transaction = False

    def next_seq(self) -> int:
        return self.execute("SELECT nextval('batch_seq') AS seq").fetchone()["seq"]

    def close(self) -> None:
        self.connection.close()


def store_url(flag: str | None) -> str | None:
    """The store's URL: `--batch-store`, else BATCHSTRING_BATCH_STORE; None: SQLite in the data
    directory. A URL with a password is refused on the command line (other users of the machine
    read command lines): put it in the environment variable, or the password in PGPASSWORD or a
    .pgpass file."""
    if flag and urlsplit(flag).password:
        raise SystemExit(f"--batch-store carries a password; command lines are visible to every user of the "
                         f"machine: set {STORE_ENV} instead, or give the password in PGPASSWORD or ~/.pgpass")
    return flag or os.environ.get(STORE_ENV) or None


def open_store(url: str | None, data_dir: Path, limits: StoreLimits | None = None) -> BatchStore:
    """SQLite and files under `data_dir` (url None or sqlite:///path), or PostgreSQL for both."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        if url and url.startswith(("postgresql://", "postgres://")):
            db = PostgresDatabase(url)
            return BatchStore(db, PostgresFiles(db), data_dir, limits)
        if url and not url.startswith("sqlite://"):
            raise SystemExit(f"--batch-store must be a postgresql:// or sqlite:/// URL; got {urlsplit(url).scheme}://")
        path = Path(urlsplit(url).path) if url else data_dir / "batchstring.db"
        return BatchStore(SQLiteDatabase(path), LocalFiles(data_dir / "files"), data_dir, limits)
    except (OSError, sqlite3.Error) as exc:
        raise SystemExit(f"the Batch API cannot keep its data in {data_dir} ({exc}): give a writable directory "
                         f"(--data-dir, or {DATA_DIR_ENV}), or turn the OpenAI API off (--no-openai)") from None
    except ImportError as exc:
        raise SystemExit(f"a PostgreSQL batch store needs psycopg ({exc})") from None
    except Exception as exc:
        if type(exc).__module__.startswith("psycopg"):
            raise SystemExit(f"the Batch API cannot reach its PostgreSQL store ({exc})") from None
        raise


# ----- the store ---------------------------------------------------------------------------------------


class BatchStore:
    def __init__(self, db: Database, files: FileStore, data_dir: Path, limits: StoreLimits | None = None) -> None:
        self.db, self.contents, self.limits = db, files, limits or StoreLimits()
        self.scratch = data_dir / "scratch"  # uploads and outputs being written: this node's own
        shutil.rmtree(self.scratch, ignore_errors=True)
        self.scratch.mkdir(parents=True)
        with self.db.transaction():
            self.contents.sweep({row["id"] for row in self.db.execute("SELECT id FROM files")}, self.db)

    @property
    def shared(self) -> bool:
        return self.db.shared

    def close(self) -> None:
        self.db.close()

    # ----- files -------------------------------------------------------------------------------

    def free_bytes(self) -> int:
        stat = os.statvfs(self.scratch)
        return stat.f_bavail * stat.f_frsize

    def upload_path(self) -> Path:
        """Where an upload or an output is written before it is stored (cleared at start)."""
        return self.scratch / uuid.uuid4().hex

    def add_file(self, owner: str, filename: str, purpose: str, written: Path) -> dict:
        file_id = _new_id("file")
        with self.db.transaction():
            size = self.contents.put(file_id, written, self.db)
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

    def open_file(self, file_id: str, offset: int = 0) -> BinaryIO:
        return self.contents.open(file_id, offset)

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self.db.transaction():
            deleted = self.db.execute("DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)).rowcount
            if deleted:
                self.contents.delete(file_id, self.db)
        return bool(deleted)

    # ----- batches -----------------------------------------------------------------------------

    def add_batch(self, owner: str, endpoint: str, input_file_id: str, window: str, window_seconds: int,
                  metadata: dict | None):
        batch_id, now = _new_id("batch"), int(time.time())
        with self.db.transaction():
            self.db.execute(
                "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, metadata, "
                "created_at, expires_at, seq) VALUES (?, ?, ?, ?, ?, 'validating', ?, ?, ?, ?)",
                (batch_id, owner, endpoint, input_file_id, window, json.dumps(metadata) if metadata else None, now,
                 now + window_seconds, self.db.next_seq()))
        return self.batch_row(batch_id)

    def batch_row(self, batch_id: str, owner: str | None = None):
        row = self.db.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row if row and (owner is None or row["owner"] == owner) else None

    def batches(self, owner: str, limit: int, after: str | None) -> list:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        anchor = self.batch_row(after, owner) if after else None
        return self.db.execute("SELECT * FROM batches WHERE owner = ? AND seq < ? ORDER BY seq DESC LIMIT ?",
                               (owner, anchor["seq"] if anchor else 2**62, limit)).fetchall()

    def in_use(self, file_id: str) -> bool:
        """True while an unfinished batch reads the file (deleting it would fail the batch)."""
        return self.db.execute(f"SELECT 1 FROM batches WHERE input_file_id = ? AND status IN ({_marks(UNFINISHED)})",
                               (file_id, *UNFINISHED)).fetchone() is not None

    def active_batches(self, owner: str) -> int:
        return self.db.execute(f"SELECT COUNT(*) AS n FROM batches WHERE owner = ? AND status IN "
                               f"({_marks(UNFINISHED)})", (owner, *UNFINISHED)).fetchone()["n"]

    def update(self, batch_id: str, **fields) -> None:
        columns = ", ".join(f"{name} = ?" for name in fields)
        self.db.execute(f"UPDATE batches SET {columns} WHERE id = ?", (*fields.values(), batch_id))

    def set_status(self, batch_id: str, status: str, **fields) -> None:
        """A new status, stamped with its time (`in_progress_at`, `completed_at`, ...)."""
        self.update(batch_id, status=status, **{f"{status}_at": int(time.time())}, **fields)

    def cancel(self, batch_id: str) -> bool:
        """cancelling, if the batch is still validating or in progress."""
        return bool(self.db.execute("UPDATE batches SET status = 'cancelling', cancelling_at = ? WHERE id = ? AND "
                                    "status IN ('validating', 'in_progress')",
                                    (int(time.time()), batch_id)).rowcount)

    # ----- leases ------------------------------------------------------------------------------

    def claim_validation(self, me: str, lease: float):
        """A batch to validate (or, made before chunks, to cut into them), leased to `me`."""
        now = time.time()
        row = self.db.execute(
            "UPDATE batches SET lease_owner = ?, lease_expires = ? WHERE id = (SELECT id FROM batches b WHERE "
            "(status = 'validating' OR (status = 'in_progress' AND NOT EXISTS (SELECT 1 FROM chunks c WHERE "
            "c.batch_id = b.id))) AND (lease_owner IS NULL OR lease_expires < ?) ORDER BY seq LIMIT 1 "
            f"{self.db.skip_locked}) RETURNING id", (me, now + lease, now)).fetchone()
        return self.batch_row(row["id"]) if row else None

    def start(self, batch_id: str, me: str, total: int, chunks: list[tuple[int, int, int]]) -> bool:
        """in_progress with its chunks ((first line, byte offset, requests) each), unless it was
        cancelled meanwhile or another replica took the validation over."""
        with self.db.transaction():
            row = self._locked(batch_id)
            if row["lease_owner"] != me or row["status"] not in ("validating", "in_progress"):
                return False
            for i, (first, offset, lines) in enumerate(chunks):
                self.db.execute("INSERT INTO chunks (batch_id, chunk, first_line, start_offset, lines) VALUES "
                                "(?, ?, ?, ?, ?) ON CONFLICT DO NOTHING", (batch_id, i, first, offset, lines))
            stamp = {} if row["status"] == "in_progress" else {"in_progress_at": int(time.time())}
            self.update(batch_id, status="in_progress", total=total, lease_owner=None, lease_expires=None, **stamp)
        return True

    def claim_chunk(self, me: str, lease: float) -> Chunk | None:
        """The oldest batch's next chunk nobody holds (or whose holder's lease lapsed)."""
        now = time.time()
        row = self.db.execute(
            "UPDATE chunks SET owner = ?, expires = ? WHERE (batch_id, chunk) = (SELECT c.batch_id, c.chunk FROM "
            "chunks c JOIN batches b ON b.id = c.batch_id WHERE b.status = 'in_progress' AND b.errors IS NULL "
            "AND b.expires_at > ? AND c.done = 0 AND (c.owner IS NULL OR c.expires < ?) ORDER BY b.seq, c.chunk "
            f"LIMIT 1 {self.db.skip_locked.replace('UPDATE', 'UPDATE OF c')}) "
            "RETURNING batch_id, chunk, first_line, start_offset, lines", (me, now + lease, now, now)).fetchone()
        if row is None:
            return None
        return Chunk(row["batch_id"], row["chunk"], row["first_line"], row["start_offset"], row["lines"])

    def renew(self, me: str, lease: float, held: list[tuple[str, int]]) -> dict[tuple[str, int], object]:
        """Extends `me`'s leases on the chunks it still works on; each one's batch row (status,
        errors, expiry), for those it still holds."""
        now, found = time.time(), {}
        for batch_id, chunk in held:
            if self.db.execute("UPDATE chunks SET expires = ? WHERE batch_id = ? AND chunk = ? AND owner = ?",
                               (now + lease, batch_id, chunk, me)).rowcount:
                found[batch_id, chunk] = self.batch_row(batch_id)
        return found

    def chunk_done(self, chunk: Chunk, me: str) -> None:
        self.db.execute("UPDATE chunks SET done = 1, owner = NULL WHERE batch_id = ? AND chunk = ?",
                        (chunk.batch_id, chunk.chunk))

    def release(self, me: str | None, chunk: Chunk | None = None) -> None:
        """Gives up `me`'s leases (one chunk's, or all); `me` None: everybody's (one node, at start:
        nobody else holds any)."""
        owner, args = ("owner = ?", (me,)) if me else ("owner IS NOT NULL", ())
        if chunk is not None:
            owner, args = owner + " AND batch_id = ? AND chunk = ?", (*args, chunk.batch_id, chunk.chunk)
        self.db.execute(f"UPDATE chunks SET owner = NULL, expires = NULL WHERE {owner}", args)
        if chunk is None:
            self.db.execute(f"UPDATE batches SET lease_owner = NULL, lease_expires = NULL WHERE "
                            f"{owner.replace('owner', 'lease_owner')}", args)

    def finalizable(self) -> list[tuple[str, str]]:
        """(batch, final status) for every batch whose work has ended and no live lease holds:
        cancelled, failed (errors recorded mid-way), completed (every chunk done), expired (past
        its window), and finalizing (an end a dead replica began: completed if every line has its
        answer)."""
        now = time.time()
        live = "EXISTS (SELECT 1 FROM chunks c WHERE c.batch_id = b.id AND c.done = 0 AND c.owner IS NOT NULL " \
               "AND c.expires >= ?)"
        open_chunks = "EXISTS (SELECT 1 FROM chunks c WHERE c.batch_id = b.id AND c.done = 0)"
        rows = self.db.execute(
            f"SELECT id, status, errors, expires_at, total, completed, failed, {live} AS live, {open_chunks} AS open "
            "FROM batches b WHERE status IN ('in_progress', 'cancelling', 'finalizing') ORDER BY seq", (now,))
        ended = []
        for row in rows.fetchall():
            if row["status"] == "finalizing":
                answered = row["completed"] + row["failed"] >= row["total"]
                ended.append((row["id"], "completed" if answered else "expired"))
            elif row["live"]:
                continue
            elif row["status"] == "cancelling":
                ended.append((row["id"], "cancelled"))
            elif row["errors"] is not None:
                ended.append((row["id"], "failed"))
            elif not row["open"]:
                ended.append((row["id"], "completed"))
            elif row["expires_at"] <= now:
                ended.append((row["id"], "expired"))
        return ended

    # ----- results -----------------------------------------------------------------------------

    def record(self, batch_id: str, lines: list[tuple[int, bool, str]]) -> int:
        """Answers for lines, in one transaction; a line already answered keeps its first answer,
        and a batch that has ended takes none. How many were new."""
        added_all = 0
        with self.db.transaction():
            row = self._locked(batch_id)
            if row is None or row["status"] in FINAL:
                return 0
            for ok in (True, False):
                rows = [(batch_id, line, int(ok), body) for line, good, body in lines if good == ok]
                if not rows:
                    continue
                added = sum(self.db.execute("INSERT INTO results VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                                            values).rowcount for values in rows)
                column = "completed" if ok else "failed"
                self.db.execute(f"UPDATE batches SET {column} = {column} + ? WHERE id = ?", (added, batch_id))
                added_all += added
        return added_all

    def answered(self, batch_id: str, first: int = 0, last: int = 2**62) -> set[int]:
        return {r["line"] for r in self.db.execute("SELECT line FROM results WHERE batch_id = ? AND line BETWEEN ? "
                                                   "AND ?", (batch_id, first, last))}

    def results(self, batch_id: str, ok: bool) -> Iterator[str]:
        rows = self.db.execute("SELECT body FROM results WHERE batch_id = ? AND ok = ? ORDER BY line",
                               (batch_id, int(ok))).fetchall()
        return (row["body"] for row in rows)

    def finish(self, batch_id: str, status: str, errors: list[dict] | None = None) -> bool:
        """Ends the batch, once: its output file (the answers) and error file (the failures, when
        there are any) written from the recorded lines, its final status, in one transaction that
        holds the batch's row. False if it had ended already. `errors`: it failed at validation,
        with these error lines and no output file."""
        with self.db.transaction():
            row = self._locked(batch_id)
            if row is None or row["status"] in FINAL:
                return False
            ids = {}
            for column, ok, lines in (("output_file_id", True, ()), ("error_file_id", False, errors or ())):
                written, count = self._write_output(batch_id, ok, lines)
                if count or (column == "output_file_id" and errors is None):
                    ids[column] = _new_id("file")
                    size = self.contents.put(ids[column], written, self.db)
                    self.db.execute("INSERT INTO files VALUES (?, ?, ?, 'batch_output', ?, ?)",
                                    (ids[column], row["owner"], f"{batch_id}_{column.removesuffix('_file_id')}.jsonl",
                                     size, int(time.time())))
                else:
                    written.unlink()
            self.set_status(batch_id, status, lease_owner=None, lease_expires=None, **ids)
            self.db.execute("DELETE FROM results WHERE batch_id = ?", (batch_id,))
            self.db.execute("DELETE FROM chunks WHERE batch_id = ?", (batch_id,))
        return True

    def _write_output(self, batch_id: str, ok: bool, extra) -> tuple[Path, int]:
        written, count = self.upload_path(), 0
        with written.open("w", encoding="utf-8") as f:
            for body in [*self.results(batch_id, ok), *(json.dumps(line) for line in extra)]:
                f.write(body + "\n")
                count += 1
        return written, count

    def _locked(self, batch_id: str):
        """The batch's row, locked until the transaction ends (SQLite: the whole database is)."""
        lock = " FOR UPDATE" if self.db.shared else ""
        return self.db.execute(f"SELECT * FROM batches WHERE id = ?{lock}", (batch_id,)).fetchone()


def _marks(values: tuple) -> str:
    return ",".join("?" * len(values))


def _file_object(row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


def batch_object(row) -> dict:
    """The batch as OpenAI returns it."""
    return {**{name: row[name] for name in BATCH_FIELDS}, "object": "batch",
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
            "request_counts": {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}}
