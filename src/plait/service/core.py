"""The training service without its RPC layer: queue, scheduler, job runners (standard library only).

:class:`Service` validates and queues jobs in a :class:`~plait.service.store.JobStore`,
starts them first come, first served when the backend has slots for every worker
(a job that does not fit waits, and so does every job behind it), watches each
running job from a thread of its own (progress reported by rank 0, a rank that
failed, the job's timeout, a cancel) and records how it ended: exit status per
rank, ``succeeded`` only if every rank exited 0. A rank that fails ends the job:
the others get :data:`ABORT_GRACE_S` seconds to exit before they are killed.

On start it adopts the jobs a previous service left ``launching`` or ``running``:
their processes still run in their own process groups, and each rank writes its
exit status to a file, so the job's final state is recorded all the same.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

from plait.errors import invalid
from plait.service.bootstrap import log_path
from plait.service.spec import INSTANCES_KEY, JobSpec, make_spec
from plait.service.store import Job, JobStore

__all__ = ["ABORT_GRACE_S", "Backend", "Handle", "Service", "job_env"]

#: Seconds the other ranks get to exit after one failed, before they are killed.
ABORT_GRACE_S = 10.0
_POLL_S = 0.2


class Handle(Protocol):
    """A started job, as a backend reports on it (:class:`~plait.service.hosts.Launched`)."""

    pgids: list[int]

    def poll(self) -> bool: ...
    def failed_rank(self) -> tuple[int, int] | None: ...
    def exit_codes(self, final: bool = True) -> dict[int, int]: ...
    def launcher_code(self) -> int | None: ...
    def kill(self) -> None: ...


class Backend(Protocol):
    """Where jobs run: :class:`~plait.service.hosts.HostsBackend` or
    :class:`~plait.service.kubernetes.KubernetesBackend`."""

    name: str

    @property
    def capacity(self) -> int: ...
    def free_slots(self) -> int: ...
    def allocate(self, spec: JobSpec) -> list[str] | None: ...
    def reserve(self, workers: list[str], per_worker: int) -> None: ...
    def release(self, workers: list[str], per_worker: int, ports: list[int] = ...) -> None: ...
    def endpoints(self, spec: JobSpec, workers: list[str]) -> list[str]: ...
    def launch(self, job_id: str, spec: JobSpec, workers: list[str], job_env: dict[str, str],
               job_dir: str, endpoints: list[str]) -> Handle: ...
    def adopt(self, job_id: str, spec: JobSpec, pgids: list[int], job_dir: str) -> Handle | None: ...


def job_env(job_id: str, spec: JobSpec, job_dir: str) -> dict[str, str]:
    """The variables every process of a job gets (the group variables come on top).

    Returns:
        ``PLAIT_JOB_ID``, ``PLAIT_JOB_NAME``, ``PLAIT_DATASET``, ``PLAIT_PARAMETERS`` (JSON),
        ``PARALLEL_INSTANCES``, ``PLAIT_OUTPUT_DIR`` (where rank 0 saves the model),
        ``PLAIT_PROGRESS_FILE`` (kept on rank 0 only) and ``PYTHONUNBUFFERED=1``.
    """
    return {
        "PLAIT_JOB_ID": job_id,
        "PLAIT_JOB_NAME": spec.name,
        "PLAIT_DATASET": spec.dataset,
        "PLAIT_PARAMETERS": json.dumps(spec.parameters, sort_keys=True),
        INSTANCES_KEY: str(spec.instances),
        "PLAIT_OUTPUT_DIR": os.path.join(job_dir, "output"),
        "PLAIT_PROGRESS_FILE": os.path.join(job_dir, "progress.jsonl"),
        "PYTHONUNBUFFERED": "1",
    }


class Service:
    """Queue, scheduler and runners over one store and one backend.

    Args:
        store: the job store.
        backend: where jobs run (:class:`~plait.service.hosts.HostsBackend`).
        code_dir: the only directory entry points may come from.
        work_dir: where job directories (logs, progress, output) are made.
        abort_grace: see :data:`ABORT_GRACE_S`.
    """

    def __init__(self, store: JobStore, backend: Backend, code_dir: str, work_dir: str,
                 abort_grace: float = ABORT_GRACE_S) -> None:
        if not os.path.isdir(code_dir):
            raise invalid("code_dir", code_dir, "an existing directory")
        self.store = store
        self.backend = backend
        self.code_dir = os.path.realpath(code_dir)
        self.work_dir = os.path.abspath(work_dir)
        self.abort_grace = abort_grace
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._cancel: dict[str, threading.Event] = {}
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Adopt the jobs a previous service left running, then start scheduling."""
        for job in self.store.list(["launching", "running"], oldest_first=True):
            self._adopt(job)
        self._thread = threading.Thread(target=self._schedule_loop, name="plait-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop scheduling (running jobs go on; a new service adopts them)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def job_dir(self, job_id: str) -> str:
        """The directory of a job's logs, progress and output."""
        return os.path.join(self.work_dir, "jobs", job_id)

    # -- requests ----------------------------------------------------------------------------
    def submit(self, **request: Any) -> Job:
        """Validate and queue a job (keywords of :func:`~plait.service.spec.make_spec` but ``code_dir``).

        Raises:
            ConfigError: on bad input (nothing is queued); CapacityError if it can never fit.
        """
        spec = make_spec(code_dir=self.code_dir, capacity=self.backend.capacity, **request)
        job = self.store.add(spec, self.backend.name)
        self._wake.set()
        return job

    def status(self, job_id: str) -> Job:
        """The job (raises UnknownJobError)."""
        return self.store.get(job_id)

    def list_jobs(self, states: Iterable[str] = ()) -> list[Job]:
        """Jobs, newest first."""
        return self.store.list(states)

    def cancel(self, job_id: str, wait: float = 30.0) -> Job:
        """Cancel a job: a queued one at once, a running one once its processes are killed.

        Args:
            job_id: the job.
            wait: seconds to wait for a running job's processes to be gone.

        Returns:
            The job as it is then (a job that had already ended is left as it was).
        """
        job = self.store.get(job_id)
        if job.state == "queued" and self.store.update(
            job_id, expect=("queued",), state="cancelled", finished=time.time(),
            message="cancelled while queued",
        ):
            return self.store.get(job_id)
        with self._lock:
            cancel, done = self._cancel.get(job_id), self._done.get(job_id)
        if cancel is not None and done is not None:
            cancel.set()
            done.wait(wait)
        return self.store.get(job_id)

    def log_file(self, job_id: str, rank: int) -> str:
        """The output file of ``rank`` (it may not exist yet).

        Raises:
            UnknownJobError: for an unknown job; ConfigError for a rank outside the job.
        """
        job = self.store.get(job_id)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < job.spec.world_size:
            raise invalid("rank", rank, f"a rank of job {job_id} in [0, {job.spec.world_size})")
        return log_path(self.job_dir(job_id), rank)

    def live_log(self, job_id: str, rank: int, follow: bool) -> Iterator[bytes] | None:
        """``rank``'s output straight from where it runs, for a backend whose logs reach the job
        directory only when the job ends (the ``kubernetes`` backend's ``stream_log``).

        Args:
            job_id: the job.
            rank: its rank (checked by :meth:`log_file` first).
            follow: stream until the rank's pod ends; else what its log holds now.

        Returns:
            The chunks, or ``None`` when the job directory's file is the place to read (another backend,
            or the job is not running: queued, or ended and its logs saved).

        Raises:
            UnknownJobError: for an unknown job; ConfigError for a rank outside the job (checked only
                where the backend streams).
        """
        stream = getattr(self.backend, "stream_log", None)
        if stream is None:
            return None
        self.log_file(job_id, rank)
        job = self.store.get(job_id)
        if job.state not in ("launching", "running"):
            return None
        chunks: Iterator[bytes] = stream(job_id, job.spec, rank, follow,
                                         lambda: self.store.get(job_id).final)
        return chunks

    # -- scheduling --------------------------------------------------------------------------
    def _schedule_loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(1.0)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._schedule()
            except Exception as exc:  # the loop must survive a bad row; report it
                print(f"plait serve: scheduler: {exc!r}", flush=True)

    def _schedule(self) -> None:
        for job in self.store.list(["queued"], oldest_first=True):
            workers = self.backend.allocate(job.spec)
            if workers is None:
                message = (f"waiting for {job.spec.world_size} free slots "
                           f"({self.backend.free_slots()} of {self.backend.capacity} free)")
                if job.message != message:
                    self.store.update(job.id, expect=("queued",), message=message)
                return  # first come, first served: the jobs behind it wait too
            if not self.store.update(job.id, expect=("queued",), state="launching", workers=workers,
                                     message=""):
                self.backend.release(workers, job.spec.processes_per_worker)
                continue
            self._track(job.id)
            threading.Thread(target=self._launch, args=(job, workers), name=f"job-{job.id}",
                             daemon=True).start()

    def _track(self, job_id: str) -> None:
        with self._lock:
            self._cancel[job_id] = threading.Event()
            self._done[job_id] = threading.Event()

    def _finish(self, job_id: str, workers: list[str], per_worker: int, ports: list[int],
                **values: Any) -> None:
        values.setdefault("finished", time.time())
        self.store.update(job_id, **values)
        self.backend.release(workers, per_worker, ports)
        with self._lock:
            done = self._done.pop(job_id, None)
            self._cancel.pop(job_id, None)
        if done is not None:
            done.set()
        self._wake.set()

    def _start(self, job_id: str, spec: JobSpec, workers: list[str],
               attempt: int) -> tuple[Handle, list[int]]:
        """Start one attempt of a job; returns its handle and the ports it took."""
        job_dir = self.job_dir(job_id)
        os.makedirs(os.path.join(job_dir, "output"), exist_ok=True)
        for name in os.listdir(job_dir):  # a previous attempt's exit files
            if name.startswith("rank-") and name.endswith(".exit"):
                os.remove(os.path.join(job_dir, name))
        endpoints = self.backend.endpoints(spec, workers)
        ports = [int(e.rpartition(":")[2]) for e in endpoints]
        env = {**job_env(job_id, spec, job_dir), "PLAIT_RESTART": str(attempt)}
        try:
            return self.backend.launch(job_id, spec, workers, env, job_dir, endpoints), ports
        except BaseException:
            self.backend.release([], spec.processes_per_worker, ports)
            raise

    def _launch(self, job: Job, workers: list[str]) -> None:
        try:
            launched, ports = self._start(job.id, job.spec, workers, job.attempts)
        except Exception as exc:
            self._finish(job.id, workers, job.spec.processes_per_worker, [], state="failed",
                         message=f"could not start the job: {exc}")
            return
        self.store.update(job.id, expect=("launching",), state="running", started=time.time(),
                          pgids=launched.pgids)
        self._run(job.id, job.spec, workers, ports, launched, job.attempts)

    def _adopt(self, job: Job) -> None:
        launched = None
        if job.state == "running":
            launched = self.backend.adopt(job.id, job.spec, list(job.pgids), self.job_dir(job.id))
        if launched is None:
            self.store.update(job.id, state="failed", finished=time.time(),
                              message="the service stopped while launching the job")
            return
        self.backend.reserve(job.workers, job.spec.processes_per_worker)
        self._track(job.id)
        args: tuple[Any, ...] = (job.id, job.spec, list(job.workers), [], launched, job.attempts)
        threading.Thread(target=self._run, args=args, name=f"job-{job.id}", daemon=True).start()

    def _run(self, job_id: str, spec: JobSpec, workers: list[str], ports: list[int], launched: Handle,
             attempt: int) -> None:
        """Watch a job to its end, relaunching it up to ``spec.restarts`` times if it fails."""
        started = self.store.get(job_id).started or time.time()
        while True:
            state, message, codes, retry = self._watch(job_id, spec, launched, started)
            with self._lock:
                cancelled = self._cancel[job_id].is_set()
            if state != "failed" or not retry or attempt >= spec.restarts or cancelled:
                break
            attempt += 1
            self.backend.release([], spec.processes_per_worker, ports)
            self.store.update(job_id, attempts=attempt, exit_codes=codes, pgids=[],
                              message=f"relaunched (restart {attempt} of {spec.restarts}) after: {message}")
            try:
                launched, ports = self._start(job_id, spec, workers, attempt)
            except Exception as exc:
                state, message, ports = "failed", f"could not relaunch the job: {exc}", []
                break
            self.store.update(job_id, pgids=launched.pgids)
            started = time.time()
        artifact = self.store.get(job_id).artifact
        output = os.path.join(self.job_dir(job_id), "output")
        if not artifact and state == "succeeded" and os.path.isdir(output) and os.listdir(output):
            artifact = output
        self._finish(job_id, workers, spec.processes_per_worker, ports, state=state, message=message,
                     exit_codes=codes, artifact=artifact)

    # -- watching ----------------------------------------------------------------------------
    def _read_progress(self, job_id: str, path: str, offset: int) -> int:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:
            return offset
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if isinstance(report, Mapping):
                self.store.merge_progress(job_id, report)
        return offset + end

    def _watch(self, job_id: str, spec: JobSpec, launched: Handle,
               started: float) -> tuple[str, str, dict[int, int], bool]:
        """Wait for one attempt to end (or end it: cancel, timeout, a failed rank).

        Returns:
            ``(state, message, exit codes, whether a relaunch may help)``.
        """
        progress_file = os.path.join(self.job_dir(job_id), "progress.jsonl")
        with self._lock:
            cancel = self._cancel[job_id]
        offset, failed_at, reason = 0, 0.0, ""
        first: tuple[int, int] | None = None
        while not launched.poll():
            offset = self._read_progress(job_id, progress_file, offset)
            now = time.time()
            if cancel.is_set():
                reason = "cancelled"
            elif spec.timeout_s and now - started > spec.timeout_s:
                reason = f"timed out after {spec.timeout_s:g} s (timeout_s)"
            elif first is None:
                first, failed_at = launched.failed_rank(), now
            elif now - failed_at > self.abort_grace:
                reason = (f"rank {first[0]} exited with status {first[1]}; the other ranks did not exit "
                          f"within {self.abort_grace:g} s and were killed")
            if reason:
                launched.kill()
                break
            cancel.wait(_POLL_S)
        self._read_progress(job_id, progress_file, offset)
        codes = launched.exit_codes()
        state, message = self._outcome(codes, launched.launcher_code(), reason)
        detail = str(getattr(launched, "message", "") or "")  # e.g. a Kubeflow job's Failed condition
        if state == "failed" and detail:
            message = f"{message} ({detail})"
        return state, message, codes, not reason.startswith(("cancelled", "timed out"))

    @staticmethod
    def _outcome(codes: Mapping[int, int], launcher: int | None, reason: str) -> tuple[str, str]:
        if reason == "cancelled":
            return "cancelled", "cancelled while running"
        bad = {r: c for r, c in sorted(codes.items()) if c != 0}
        if reason:
            return "failed", reason
        if not bad and launcher in (None, 0):
            return "succeeded", ""
        if bad:
            first = next(iter(bad.items()))
            lost = " (no exit status: lost)" if first[1] == -1 else ""
            return "failed", f"rank {first[0]} exited with status {first[1]}{lost}; {len(bad)} rank(s) failed"
        return "failed", f"the launcher exited with status {launcher}"
