"""The job store: one SQLite file that survives restarts of the service (standard library only).

A job moves ``queued -> launching -> running -> succeeded | failed | cancelled``
(``queued`` and ``launching`` can also go straight to ``failed`` or
``cancelled``). Every change is one committed transaction, so a service killed
with ``kill -9`` finds every job as it was last recorded; the job's processes
run in process groups of their own and write their exit codes to files, so a
restarted service can adopt the jobs that were running (see
:mod:`plait.service.core`).
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from plait.errors import ConfigError, invalid
from plait.service.spec import JobSpec

__all__ = ["FINAL_STATES", "STATES", "Job", "JobStore", "UnknownJobError"]

#: Every state, in the order a job goes through them.
STATES = ("queued", "launching", "running", "succeeded", "failed", "cancelled")
#: States a job never leaves.
FINAL_STATES = ("succeeded", "failed", "cancelled")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    spec TEXT NOT NULL,
    state TEXT NOT NULL,
    created REAL NOT NULL,
    started REAL NOT NULL DEFAULT 0,
    finished REAL NOT NULL DEFAULT 0,
    exit_codes TEXT NOT NULL DEFAULT '{}',
    progress TEXT NOT NULL DEFAULT '{}',
    message TEXT NOT NULL DEFAULT '',
    artifact TEXT NOT NULL DEFAULT '',
    workers TEXT NOT NULL DEFAULT '[]',
    pgids TEXT NOT NULL DEFAULT '[]',
    backend TEXT NOT NULL DEFAULT '',
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs (state, seq);
"""
_COLUMNS = ("id", "seq", "spec", "state", "created", "started", "finished", "exit_codes",
            "progress", "message", "artifact", "workers", "pgids", "backend", "attempts")
_JSON = {"exit_codes", "progress", "workers", "pgids"}


class UnknownJobError(ConfigError, LookupError):
    """No job has this id (the server answers ``NOT_FOUND``)."""


@dataclass
class Job:
    """One row of the store.

    Attributes:
        id: the job id.
        seq: submission order.
        spec: what was asked for.
        state: one of :data:`STATES`.
        created, started, finished: Unix times (0: not yet).
        exit_codes: ``{rank: exit status}`` (negative: killed by that signal).
        progress: what rank 0 reported last (``step``, ``epoch``, ``loss``, ``metrics``,
            ``updated_at``).
        message: why it failed, was cancelled, or what it waits for.
        artifact: what rank 0 reported as its saved model.
        workers: the host of each worker.
        pgids: process groups of the running job (to adopt or kill it after a restart).
        backend: the backend that runs it (``hosts`` or ``kubernetes``).
        attempts: relaunches so far (see ``JobSpec.restarts``).
    """

    id: str
    seq: int
    spec: JobSpec
    state: str
    created: float
    started: float = 0.0
    finished: float = 0.0
    exit_codes: dict[int, int] = field(default_factory=dict)
    progress: dict[str, Any] = field(default_factory=dict)
    message: str = ""
    artifact: str = ""
    workers: list[str] = field(default_factory=list)
    pgids: list[int] = field(default_factory=list)
    backend: str = ""
    attempts: int = 0

    @property
    def final(self) -> bool:
        """Whether the job has ended."""
        return self.state in FINAL_STATES


class JobStore:
    """Jobs in a SQLite file; safe to use from several threads.

    Args:
        path: the database file (created with its directory), or ``":memory:"``.

    Raises:
        ConfigError: if the file cannot be opened as a database.
    """

    def __init__(self, path: str) -> None:
        if not isinstance(path, str) or not path:
            raise invalid("path", path, "a file path for the SQLite job store")
        if path != ":memory:":
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._lock = threading.RLock()
        try:
            self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise invalid("store", path, f"a SQLite database file ({exc})") from None

    def close(self) -> None:
        """Close the database."""
        with self._lock:
            self._db.close()

    def _row(self, row: tuple[Any, ...]) -> Job:
        data = dict(zip(_COLUMNS, row, strict=True))
        for key in _JSON:
            data[key] = json.loads(data[key])
        data["exit_codes"] = {int(k): int(v) for k, v in data["exit_codes"].items()}
        data["spec"] = JobSpec.from_json(data["spec"])
        return Job(**data)

    def add(self, spec: JobSpec, backend: str) -> Job:
        """Queue a new job.

        Args:
            spec: the validated job.
            backend: the backend that will run it.

        Returns:
            The new job, in state ``queued``.
        """
        with self._lock:
            seq = int(self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs").fetchone()[0])
            job_id = f"{time.strftime('%Y%m%d')}-{uuid.uuid4().hex[:8]}"
            now = time.time()
            self._db.execute(
                "INSERT INTO jobs (id, seq, spec, state, created, backend) VALUES (?, ?, ?, ?, ?, ?)",
                (job_id, seq, spec.to_json(), "queued", now, backend),
            )
        return self.get(job_id)

    def get(self, job_id: str) -> Job:
        """The job with this id.

        Raises:
            UnknownJobError: if there is none.
        """
        with self._lock:
            row = self._db.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
        if row is None:
            raise UnknownJobError(f"invalid job_id={job_id!r}: no such job (see 'plait jobs list')")
        return self._row(row)

    def list(self, states: Iterable[str] = (), oldest_first: bool = False) -> list[Job]:
        """Jobs, newest first (or oldest first), optionally only in ``states``."""
        wanted = list(states)
        for state in wanted:
            if state not in STATES:
                raise invalid("states", state, f"states among {', '.join(STATES)}")
        order = "ASC" if oldest_first else "DESC"
        query = f"SELECT {', '.join(_COLUMNS)} FROM jobs"
        if wanted:
            query += f" WHERE state IN ({', '.join('?' * len(wanted))})"
        with self._lock:
            rows = self._db.execute(f"{query} ORDER BY seq {order}", wanted).fetchall()
        return [self._row(r) for r in rows]

    def update(self, job_id: str, *, expect: Iterable[str] | None = None, **values: Any) -> bool:
        """Change some columns of a job in one transaction.

        Args:
            job_id: the job.
            expect: change it only if its state is one of these (a cancel racing with a
                launch); ``None``: always.
            **values: columns to set (JSON columns take Python objects).

        Returns:
            Whether the job was changed.
        """
        unknown = set(values) - set(_COLUMNS[2:])
        if unknown:
            raise invalid("values", sorted(unknown), f"columns among {_COLUMNS[2:]}")
        if "state" in values and values["state"] not in STATES:
            raise invalid("state", values["state"], f"one of {', '.join(STATES)}")
        sets, params = [], []
        for key, value in values.items():
            sets.append(f"{key} = ?")
            if key in _JSON:
                if key == "exit_codes":
                    value = {str(k): int(v) for k, v in dict(value).items()}
                value = json.dumps(value, sort_keys=True)
            params.append(value)
        query = f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?"
        params.append(job_id)
        if expect is not None:
            states = list(expect)
            query += f" AND state IN ({', '.join('?' * len(states))})"
            params += states
        with self._lock:
            return self._db.execute(query, params).rowcount == 1

    def merge_progress(self, job_id: str, report: Mapping[str, Any]) -> None:
        """Fold one progress report of rank 0 into the job's progress and artifact."""
        with self._lock:
            job = self.get(job_id)
            progress = dict(job.progress)
            for key in ("step", "epoch", "loss"):
                if report.get(key) is not None:
                    progress[key] = report[key]
            if report.get("metrics"):
                progress["metrics"] = {**progress.get("metrics", {}), **report["metrics"]}
            progress["updated_at"] = float(report.get("time", time.time()))
            values: dict[str, Any] = {"progress": progress}
            if report.get("artifact"):
                values["artifact"] = str(report["artifact"])
            self.update(job_id, **values)
