"""``plait serve``: the gRPC training service (needs ``pip install 'plait[service]'``).

Usage::

    plait serve [--listen 127.0.0.1:50051] [--work-dir DIR] [--store FILE] [--code-dir DIR]
                [--slots N | -H host:slots,... | --hostfile FILE] [--agent CMD]
                [--network-interface IF] [--token-file FILE] [--abort-grace S]
                [--backend kubernetes --image IMAGE [--namespace NS] [--context C] [--kubeconfig F]
                 [--slot-resource RESOURCE=QUANTITY] [--k8s-operator pods|kubeflow|auto]]

It listens on localhost unless told otherwise, has gRPC reflection on (``grpcurl
-plaintext 127.0.0.1:50051 list``), and with ``--token-file`` requires the
metadata ``authorization: Bearer TOKEN`` on every call. On start it prints
``plait serve: listening on HOST:PORT`` (port 0 picks a free one). SIGTERM or
SIGINT stops it; running jobs go on, and the next service adopts them.
"""

from __future__ import annotations

import argparse
import hmac
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2
from grpc_reflection.v1alpha import reflection

from plait.errors import ConfigError
from plait.launch.hostfile import HostSlots, parse_hostfile, parse_hosts
from plait.service import training_pb2 as pb
from plait.service import training_pb2_grpc as pb_grpc
from plait.service.core import Backend, Service
from plait.service.hosts import HostsBackend
from plait.service.kubernetes import KubernetesBackend
from plait.service.spec import CapacityError
from plait.service.store import STATES, Job, JobStore, UnknownJobError

__all__ = ["TrainingServicer", "build_parser", "job_status", "main", "make_server"]

_STATE = {name: pb.JobState.Value(name.upper()) for name in STATES}
_CHUNK = 1 << 16


def job_status(job: Job) -> pb.JobStatus:
    """The ``JobStatus`` message of a stored job."""
    progress = pb.Progress(metrics={k: float(v) for k, v in job.progress.get("metrics", {}).items()},
                           updated_at=float(job.progress.get("updated_at", 0.0)))
    for key in ("step", "epoch"):
        if job.progress.get(key) is not None:
            setattr(progress, key, int(job.progress[key]))
    if job.progress.get("loss") is not None:
        progress.loss = float(job.progress["loss"])
    params = struct_pb2.Struct()
    params.update(job.spec.parameters)
    return pb.JobStatus(
        job_id=job.id, name=job.spec.name, state=_STATE[job.state], framework=job.spec.framework,
        instances=job.spec.instances, processes_per_worker=job.spec.processes_per_worker,
        created_at=job.created, started_at=job.started, finished_at=job.finished,
        exit_codes=[pb.RankExit(rank=r, exit_code=c) for r, c in sorted(job.exit_codes.items())],
        progress=progress, message=job.message, artifact=job.artifact, workers=job.workers,
        entry_point=job.spec.entry_point, dataset=job.spec.dataset, parameters=params,
        attempts=job.attempts, restarts=job.spec.restarts,
    )


def _abort(context: grpc.ServicerContext, exc: Exception) -> None:
    if isinstance(exc, UnknownJobError):
        code = grpc.StatusCode.NOT_FOUND
    elif isinstance(exc, CapacityError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT
    context.abort(code, str(exc))


class TrainingServicer(pb_grpc.TrainingServicer):
    """The RPCs of ``plait.service.v1.Training`` over a :class:`~plait.service.core.Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def Train(self, request: pb.TrainRequest, context: grpc.ServicerContext) -> pb.TrainResponse:  # noqa: N802
        try:
            job = self.service.submit(
                name=request.name, entry_point=request.entry_point, args=list(request.args),
                dataset=request.dataset, parameters=json_format.MessageToDict(request.parameters),
                framework=request.framework or "none",
                processes_per_worker=request.processes_per_worker or 1, timeout_s=request.timeout_s,
                restarts=request.restarts,
            )
        except (ValueError, TypeError) as exc:
            _abort(context, exc)
        return pb.TrainResponse(job_id=job.id, state=_STATE[job.state])

    def GetTrainingStatus(self, request: pb.StatusRequest,  # noqa: N802
                          context: grpc.ServicerContext) -> pb.JobStatus:
        try:
            return job_status(self.service.status(request.job_id))
        except (ValueError, TypeError) as exc:
            _abort(context, exc)
            raise

    def ListJobs(self, request: pb.ListJobsRequest,  # noqa: N802
                 context: grpc.ServicerContext) -> pb.ListJobsResponse:
        names = {v: k for k, v in _STATE.items()}
        try:
            states = [names[s] for s in request.states]
        except KeyError:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"invalid states={list(request.states)!r}: "
                          f"expected states among {', '.join(STATES)}")
        return pb.ListJobsResponse(jobs=[job_status(j) for j in self.service.list_jobs(states)])

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.JobStatus:  # noqa: N802
        try:
            return job_status(self.service.cancel(request.job_id))
        except (ValueError, TypeError) as exc:
            _abort(context, exc)
            raise

    def Logs(self, request: pb.LogsRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:  # noqa: N802
        try:
            path = self.service.log_file(request.job_id, int(request.rank))
        except (ValueError, TypeError) as exc:
            _abort(context, exc)
            raise
        offset, live_done = 0, False
        while context.is_active():
            if not live_done:  # kubernetes: from the pod while it runs; the log saved at the end has the rest
                live = self.service.live_log(request.job_id, int(request.rank), request.follow)
                if live is not None:
                    live_done = True
                    for data in live:
                        if not context.is_active():
                            return
                        offset += len(data)
                        yield pb.LogChunk(rank=request.rank, data=data)
                    if not request.follow:
                        return
            final = self.service.status(request.job_id).final
            data = b""
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(_CHUNK)
            except FileNotFoundError:
                pass
            if data:
                offset += len(data)
                yield pb.LogChunk(rank=request.rank, data=data)
                continue
            if not request.follow or final:
                return
            time.sleep(0.2)


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses calls without ``authorization: Bearer TOKEN`` (UNAUTHENTICATED)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong token: send metadata 'authorization: Bearer TOKEN' "
                          "(plait jobs --token-file FILE, or PLAIT_SERVICE_TOKEN)")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if details.method.startswith("/grpc.reflection."):
            return continuation(details)
        given = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(str(given).encode(), self._expected):
            return continuation(details)
        return self._deny


def make_server(service: Service, listen: str, token: str | None = None) -> tuple[grpc.Server, int]:
    """A started gRPC server for ``service``.

    Args:
        service: the service.
        listen: ``HOST:PORT`` (port 0: a free one).
        token: require ``authorization: Bearer TOKEN``; ``None``: no token.

    Returns:
        The server and the port it listens on.

    Raises:
        ConfigError: if it cannot listen there.
    """
    interceptors = [_TokenInterceptor(token)] if token else []
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=16), interceptors=interceptors)
    pb_grpc.add_TrainingServicer_to_server(TrainingServicer(service), server)
    names = (pb.DESCRIPTOR.services_by_name["Training"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise ConfigError(f"invalid --listen={listen!r}: cannot listen there ({exc})") from None
    if port == 0:
        raise ConfigError(f"invalid --listen={listen!r}: cannot listen there (address in use?)")
    server.start()
    return server, port


def build_parser() -> argparse.ArgumentParser:
    """The ``plait serve`` argument parser."""
    p = argparse.ArgumentParser(prog="plait serve", description="Run the plait training service.")
    p.add_argument("--listen", default="127.0.0.1:50051", metavar="HOST:PORT",
                   help="address to listen on (default 127.0.0.1:50051; port 0: a free one)")
    p.add_argument("--work-dir", default="plait-service", metavar="DIR",
                   help="job directories (logs, progress, output); default ./plait-service")
    p.add_argument("--store", metavar="FILE", help="SQLite job store (default WORK_DIR/jobs.db)")
    p.add_argument("--code-dir", default=".", metavar="DIR",
                   help="entry points must be files inside this directory (default: .)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--slots", type=int, metavar="N",
                       help="process slots on this machine (default: its CPU count); kubernetes: in the "
                            "cluster (default: what its nodes can hold, see --slot-resource)")
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="hosts and their slots")
    where.add_argument("--hostfile", metavar="FILE", help="hostfile of 'HOST slots=N' lines")
    p.add_argument("--agent", metavar="CMD",
                   help="command that starts a process on another host: CMD HOST 'COMMAND' (e.g. ssh)")
    p.add_argument("--network-interface", metavar="IF", help="interface or CIDR for MPI traffic")
    p.add_argument("--token-file", metavar="FILE", help="require this token from clients")
    p.add_argument("--backend", choices=("hosts", "kubernetes"), default="hosts",
                   help="hosts (default) or kubernetes (the in-cluster service account or the "
                        "kubeconfig's current context; needs --image)")
    p.add_argument("--image", help="kubernetes: the container image of the workers")
    p.add_argument("--image-code-dir", default="/code",
                   help="kubernetes: where --code-dir's content is in the image (default /code)")
    p.add_argument("--namespace", default="default", help="kubernetes: namespace of the jobs")
    p.add_argument("--context", help="kubernetes: the kubeconfig context (default: its current one)")
    p.add_argument("--kubeconfig", metavar="FILE",
                   help="kubernetes: the kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    p.add_argument("--slot-resource", default="cpu=1", metavar="RESOURCE=QUANTITY",
                   help="kubernetes: what one process asks for (default cpu=1; e.g. nvidia.com/gpu=1); "
                        "without --slots the capacity is what the cluster's nodes can hold of it")
    p.add_argument("--k8s-operator", choices=("pods", "kubeflow", "auto"), default="pods",
                   help="kubernetes: torch/tensorflow jobs as an indexed Job and a Service (pods, default), "
                        "as Kubeflow PyTorchJob/TFJob (kubeflow), or those where the cluster serves the "
                        "CRD (auto)")
    p.add_argument("--k8s-output-pvc", metavar="CLAIM",
                   help="kubernetes: an existing PersistentVolumeClaim in --namespace that every pod "
                        "mounts at PLAIT_OUTPUT_DIR under the job id, so that models and checkpoints "
                        "outlive the pods (default: an emptyDir, deleted with them)")
    p.add_argument("--abort-grace", type=float, default=10.0, metavar="S",
                   help="seconds the other ranks get after one failed (default 10)")
    return p


def _hosts(args: argparse.Namespace) -> list[HostSlots]:
    if args.hosts is not None:
        return parse_hosts(args.hosts)
    if args.hostfile is not None:
        return parse_hostfile(args.hostfile)
    slots = os.cpu_count() or 1 if args.slots is None else args.slots
    if isinstance(slots, bool) or slots < 1:
        raise ConfigError(f"invalid --slots={slots!r}: expected an integer >= 1")
    return [HostSlots("localhost", slots)]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``plait serve``.

    Returns:
        0 after SIGTERM/SIGINT, 2 on bad arguments.
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        import shlex

        token = None
        if args.token_file:
            with open(args.token_file) as f:
                token = f.read().strip()
            if not token:
                raise ConfigError(f"invalid --token-file={args.token_file!r}: the file is empty")
        backend: Backend
        if args.backend == "kubernetes":
            if not args.image:
                raise ConfigError("invalid --image=None: the kubernetes backend needs the workers' image")
            backend = KubernetesBackend(args.slots, args.image, args.code_dir, args.image_code_dir,
                                        args.namespace, context=args.context,
                                        kubeconfig=args.kubeconfig, slot=args.slot_resource,
                                        operator=args.k8s_operator, output_pvc=args.k8s_output_pvc)
        else:
            backend = HostsBackend(_hosts(args), shlex.split(args.agent) if args.agent else None,
                                   args.network_interface)
        work_dir = os.path.abspath(args.work_dir)
        store = JobStore(args.store or os.path.join(work_dir, "jobs.db"))
        service = Service(store, backend, args.code_dir, work_dir, abort_grace=args.abort_grace)
        service.start()
        server, port = make_server(service, args.listen, token)
    except (ConfigError, OSError) as exc:
        print(f"plait serve: error: {exc}", file=sys.stderr)
        return 2
    host = args.listen.rpartition(":")[0]
    print(f"plait serve: listening on {host}:{port} (backend {backend.name}, {backend.capacity} slots, "
          f"store {store.path})", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopped.set())
    stopped.wait()
    server.stop(grace=2).wait()
    service.stop()
    store.close()
    return 0
