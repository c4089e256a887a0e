"""How the ``kubernetes`` backend follows a job it created: its pods' phases and exit codes, an
MPIJob's launcher, a PyTorchJob/TFJob's conditions; the logs saved and the objects deleted at the end.

:class:`KubeLaunched` is the backend's job handle (the :class:`~plait.service.core.Handle` of a job on
Kubernetes); it makes its API calls through its backend's :class:`~plait.service.kubeapi.Cluster`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.errors import ConfigError
from plait.progress import PROGRESS_LINE
from plait.service.bootstrap import log_path
from plait.service.kubeflow import CRDS, job_state, replica_rank

if TYPE_CHECKING:
    from plait.service.kubernetes import KubernetesBackend

__all__ = ["INDEX_ANNOTATION", "PROGRESS_TAIL", "KubeLaunched", "is_launcher", "pod_exit", "pod_index"]

#: The pod annotation holding its index in an indexed Job.
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
#: Lines of rank 0's log read at each poll for progress reports.
PROGRESS_TAIL = 200


def pod_index(pod: Any) -> int | None:
    """A pod's index in its indexed Job (its annotation, else its label)."""
    meta = pod.metadata
    for values in (meta.annotations, meta.labels):
        if values and values.get(INDEX_ANNOTATION) is not None:
            return int(values[INDEX_ANNOTATION])
    return None


def is_launcher(pod: Any) -> bool:
    """Whether a pod is an MPIJob's launcher (the operator's role label, or our container name)."""
    labels = pod.metadata.labels or {}
    if labels.get("training.kubeflow.org/job-role") == "launcher":
        return True
    containers = pod.spec.containers if pod.spec is not None else []
    return bool(containers) and containers[0].name == "launcher"


def pod_exit(pod: Any) -> int | None:
    """A pod's exit status from its phase and containers; ``None`` while it may still run.

    ``Succeeded``: 0; ``Failed``: its first container's non-zero exit code, else -1 (no code: evicted,
    deadline); ``Pending``, ``Running``, ``Unknown``: ``None`` unless every container has terminated.
    """
    status = pod.status
    if status is None:
        return None
    statuses = list(status.container_statuses or [])
    codes = [int(s.state.terminated.exit_code) for s in statuses
             if s.state is not None and s.state.terminated is not None]
    if status.phase not in ("Succeeded", "Failed") and not (statuses and len(codes) == len(statuses)):
        return None
    bad = [c for c in codes if c != 0]
    if bad:
        return bad[0]
    return -1 if status.phase == "Failed" else 0


@dataclass
class KubeLaunched:
    """A job's objects created in the cluster; watched through its pods (``plait.dev/job=JOB_ID``).

    An indexed Job's pod ``i`` holds ranks ``i*per_worker ...``: each gets the pod's exit status. An
    MPIJob's outcome is its launcher pod's: when it exits 0 (``mpirun`` exits 0 only if every rank did)
    every rank is 0, otherwise the ranks' statuses are unknown and :meth:`launcher_code` has it.

    Attributes:
        backend: the backend (its cluster and poll interval).
        job_id: the job.
        objects: the objects created (what clean-up deletes).
        world_size: ranks.
        per_worker: processes per pod.
        job_dir: where the pods' logs are saved when the job ends (``rank-N.log``).
        message: why a PyTorchJob/TFJob failed (its ``Failed`` condition; the service adds it to the
            job's status message).
    """

    backend: KubernetesBackend
    job_id: str
    objects: list[dict[str, Any]]
    world_size: int
    per_worker: int
    job_dir: str
    pgids: list[int] = field(default_factory=list)
    _codes: dict[int, int] = field(default_factory=dict)
    _launcher: int | None = None
    _ended: bool = False
    _seen: bool = False
    _last: float = float("-inf")
    _failing_since: float | None = None
    _progress_at: float = float("-inf")
    message: str = ""

    @property
    def mpi(self) -> bool:
        """Whether the job is an MPIJob."""
        return any(o["kind"] == "MPIJob" for o in self.objects)

    @property
    def operator_kind(self) -> str | None:
        """``PyTorchJob`` or ``TFJob`` for a job of the Kubeflow training operator, else ``None``."""
        return next((o["kind"] for o in self.objects if o["kind"] in CRDS), None)

    def poll(self) -> bool:
        """Whether the job has ended (asks the API at most every ``backend.poll_s`` seconds).

        An indexed Job ends when every pod has ended, or one failed and none still runs (``backoffLimit:
        0``: one failed pod fails the Job); an MPIJob when its launcher pod has ended; a PyTorchJob or
        TFJob when its ``Succeeded`` or ``Failed`` condition is true (each rank's status from its pod where
        seen; after ``Succeeded`` the others are 0). Then the pods' logs are saved and the objects deleted.
        Pods (a PyTorchJob/TFJob: the object) seen before and now gone (deleted from outside), or the API
        failing for ``backend.api_grace_s`` seconds in a row, end the job with unknown statuses (-1).
        """
        now = time.monotonic()
        if self._ended or now - self._last < self.backend.poll_s:
            return self._ended
        self._last = now
        kind = self.operator_kind
        try:
            pods = self.backend.cluster.pods(self.job_id)
            custom = self.backend.cluster.get_custom(self.objects[0]) if kind else None
        except ConfigError as exc:
            if self._failing_since is None:
                self._failing_since = now
            if now - self._failing_since < self.backend.api_grace_s:
                return False
            print(f"plait serve: job {self.job_id}: {exc}; given up after "
                  f"{self.backend.api_grace_s:g} s", flush=True)
            self._ended = True
            self._cleanup([])
            return True
        self._failing_since = None
        self._read_progress(pods)
        if self.mpi:
            self._poll_mpijob(pods)
        elif kind:
            self._poll_operator(kind, pods, custom)
        else:
            self._poll_job(pods)
        gone = custom is None if kind else not pods
        if self._seen and gone:
            self._ended = True  # deleted from outside: the statuses not seen are unknown
        self._seen = self._seen or not gone
        if self._ended:
            self._cleanup(pods)
        return self._ended

    def _poll_job(self, pods: Sequence[Any]) -> None:
        codes = self._codes  # an ended pod stays ended, even once it is gone
        running = False
        for pod in pods:
            index, code = pod_index(pod), pod_exit(pod)
            if code is None:
                running = True
            elif index is not None:
                for local in range(self.per_worker):
                    codes[index * self.per_worker + local] = code
        self._ended = bool(pods) and not running and (
            len(codes) == self.world_size or any(c != 0 for c in codes.values()))

    def _poll_mpijob(self, pods: Sequence[Any]) -> None:
        for pod in pods:
            if is_launcher(pod) and (code := pod_exit(pod)) is not None:
                self._launcher, self._ended = code, True
                self._codes = {r: 0 for r in range(self.world_size)} if code == 0 else {}

    def _poll_operator(self, kind: str, pods: Sequence[Any], custom: Mapping[str, Any] | None) -> None:
        for pod in pods:
            rank, code = replica_rank(kind, pod.metadata.labels), pod_exit(pod)
            if rank is not None and code is not None and rank < self.world_size:
                self._codes[rank] = code
        state, message = job_state(custom)
        if state == "succeeded":
            self._ended = True
            for rank in range(self.world_size):
                self._codes.setdefault(rank, 0)
        elif state == "failed":
            self._ended, self.message = True, f"{kind} failed: {message}" if message else ""
            print(f"plait serve: job {self.job_id}: {kind} failed: {message}", flush=True)

    def _cleanup(self, pods: Sequence[Any]) -> None:
        """Save the pods' logs, then delete the objects (on completion and on cancel)."""
        self._save_logs(pods)
        self.backend.delete_objects(self.objects)
        self.backend.forget(self.job_id)

    def _first_rank(self, pod: Any) -> int | None:
        """The first rank whose output is in ``pod``'s log (None: no rank's)."""
        if self.mpi:
            return 0 if is_launcher(pod) else None  # mpirun forwards every rank's output there
        if self.operator_kind:
            return replica_rank(self.operator_kind, pod.metadata.labels)
        index = pod_index(pod)
        return None if index is None else index * self.per_worker

    def _read_progress(self, pods: Sequence[Any]) -> None:
        """Append the progress reports newer than those seen from rank 0's log (the last
        ``PROGRESS_TAIL`` lines) to the job's ``progress.jsonl``, which the service reads."""
        for pod in pods:
            if self._first_rank(pod) != 0:
                continue
            try:
                text = self.backend.cluster.log(pod.metadata.name, tail=PROGRESS_TAIL)
            except ConfigError:
                return  # not started yet
            new = []
            for line in text.splitlines():
                start = line.find(PROGRESS_LINE)
                if start < 0:
                    continue
                try:
                    report = json.loads(line[start + len(PROGRESS_LINE):])
                    when = float(report["time"])
                except (ValueError, KeyError, TypeError):
                    continue
                if when > self._progress_at:
                    new.append(line[start + len(PROGRESS_LINE):])
                    self._progress_at = when
            if new:
                with open(os.path.join(self.job_dir, "progress.jsonl"), "a") as f:
                    f.write("".join(f"{entry}\n" for entry in new))
            return

    def _save_logs(self, pods: Sequence[Any]) -> None:
        for pod in pods:
            rank = self._first_rank(pod)
            if rank is None:
                continue
            try:
                text = self.backend.cluster.log(pod.metadata.name)
            except ConfigError:
                continue  # a pod that never started has no log
            with open(log_path(self.job_dir, rank), "w") as f:
                f.write(text)

    def failed_rank(self) -> tuple[int, int] | None:
        """The first rank known to have failed."""
        return next(((r, c) for r, c in sorted(self._codes.items()) if c != 0), None)

    def exit_codes(self, final: bool = True) -> dict[int, int]:
        """Exit status per rank (a pod's status for each of its ranks; -1: unknown)."""
        codes = dict(self._codes)
        if final and not (self.mpi and self._launcher not in (None, 0)):
            for rank in range(self.world_size):
                codes.setdefault(rank, -1)
        return codes

    def launcher_code(self) -> int | None:
        """An MPIJob's launcher pod's exit status (``None`` for an indexed Job or while it runs)."""
        return self._launcher

    def kill(self) -> None:
        """Save the pods' logs and delete the job's objects (their pods go with them)."""
        try:
            pods = self.backend.cluster.pods(self.job_id)
        except ConfigError:
            pods = []
        self._cleanup(pods)
