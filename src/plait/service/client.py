"""``plait jobs``: the command-line client of ``plait serve`` (needs ``pip install 'plait[service]'``).

Usage::

    plait jobs [--server HOST:PORT] [--token-file FILE] [--json] COMMAND ...
    plait jobs submit --name NAME --framework torch|tensorflow|horovod|mpi|none
                      [--instances N] [--processes-per-worker P] [-p KEY=VALUE]...
                      [--parameters JSON] [--dataset D] [--timeout S] [--wait] ENTRY_POINT [-- ARGS...]
    plait jobs status JOB_ID [--wait]
    plait jobs list [--state STATE]...
    plait jobs cancel JOB_ID
    plait jobs logs JOB_ID [--rank R] [--follow]

The server is ``--server``, else ``PLAIT_SERVICE``, else ``127.0.0.1:50051``; the
token ``--token-file``, else ``PLAIT_SERVICE_TOKEN``. Errors from the service are
printed with their gRPC status (``INVALID_ARGUMENT``, ``NOT_FOUND``,
``RESOURCE_EXHAUSTED``) and exit status 1; bad usage exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import grpc
from google.protobuf import json_format

from plait.service import training_pb2 as pb
from plait.service import training_pb2_grpc as pb_grpc

__all__ = ["build_parser", "format_status", "main"]

_FINAL = {pb.SUCCEEDED, pb.FAILED, pb.CANCELLED}


def _state(value: int) -> str:
    return str(pb.JobState.Name(value)).lower()


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def format_status(s: pb.JobStatus) -> str:
    """A job's status as lines for people."""
    lines = [f"job {s.job_id} ({s.name}): {_state(s.state)}",
             f"  framework {s.framework}, {s.instances} instance(s) x {s.processes_per_worker} process(es)"
             f" on {', '.join(s.workers) or '-'}",
             f"  created {_when(s.created_at)}  started {_when(s.started_at)}  "
             f"finished {_when(s.finished_at)}"]
    p = s.progress
    if p.updated_at:
        parts = [f"{k} {getattr(p, k):g}" for k in ("step", "epoch", "loss") if p.HasField(k)]
        parts += [f"{k} {v:g}" for k, v in sorted(p.metrics.items())]
        lines.append(f"  progress: {', '.join(parts)} (at {_when(p.updated_at)})")
    if s.exit_codes:
        lines.append("  exit codes: " + " ".join(f"rank{e.rank}={e.exit_code}" for e in s.exit_codes))
    if s.artifact:
        lines.append(f"  artifact: {s.artifact}")
    if s.restarts:
        lines.append(f"  restarts: {s.attempts} of {s.restarts}")
    if s.message:
        lines.append(f"  message: {s.message}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The ``plait jobs`` argument parser."""
    p = argparse.ArgumentParser(prog="plait jobs", description="Client of the plait training service.")
    p.add_argument("--server", default=os.environ.get("PLAIT_SERVICE", "127.0.0.1:50051"),
                   metavar="HOST:PORT")
    p.add_argument("--token-file", metavar="FILE", help="send this token (else PLAIT_SERVICE_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the service's answers as JSON")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="queue a job")
    s.add_argument("--name", required=True)
    s.add_argument("--framework", required=True, help="torch, tensorflow, horovod, mpi or none")
    s.add_argument("--instances", metavar="N", help="PARALLEL_INSTANCES (default 1)")
    s.add_argument("--processes-per-worker", type=int, default=1, metavar="P")
    s.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a hyper-parameter (string)")
    s.add_argument("--parameters", metavar="JSON", help="hyper-parameters as a JSON object of strings")
    s.add_argument("--dataset", default="")
    s.add_argument("--timeout", type=float, default=0.0, metavar="S")
    s.add_argument("--restarts", type=int, default=0, metavar="R",
                   help="relaunch the job up to R times if it fails (it resumes from its checkpoints)")
    s.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 if it succeeded")
    s.add_argument("entry_point", help="a file inside the service's code directory")
    s.add_argument("args", nargs=argparse.REMAINDER, help="-- ARGS for the entry point")
    st = sub.add_parser("status", help="a job's status")
    st.add_argument("job_id")
    st.add_argument("--wait", action="store_true", help="wait for the job to end; exit 0 if it succeeded")
    ls = sub.add_parser("list", help="every job, newest first")
    ls.add_argument("--state", action="append", default=[],
                    choices=["queued", "launching", "running", "succeeded", "failed", "cancelled"])
    c = sub.add_parser("cancel", help="cancel a job")
    c.add_argument("job_id")
    lg = sub.add_parser("logs", help="a rank's output")
    lg.add_argument("job_id")
    lg.add_argument("--rank", type=int, default=0)
    lg.add_argument("-f", "--follow", action="store_true", help="stream until the job ends")
    return p


def _parameters(args: argparse.Namespace) -> dict[str, Any]:
    params: dict[str, Any] = {}
    if args.parameters:
        try:
            params.update(json.loads(args.parameters))
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"plait jobs: error: invalid --parameters={args.parameters!r}: "
                             f"expected a JSON object ({exc})") from None
    for item in args.param:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"plait jobs: error: invalid -p {item!r}: expected KEY=VALUE")
        params[key] = value
    if args.instances is not None:
        params["PARALLEL_INSTANCES"] = args.instances
    return params


def _wait(stub: pb_grpc.TrainingStub, job_id: str, metadata: list[tuple[str, str]]) -> pb.JobStatus:
    while True:
        status = stub.GetTrainingStatus(pb.StatusRequest(job_id=job_id), metadata=metadata)
        if status.state in _FINAL:
            return status
        time.sleep(0.5)


def _print(message: Any, as_json: bool, text: str) -> None:
    if as_json:
        print(json_format.MessageToJson(message, preserving_proto_field_name=True))
    else:
        print(text)


def _run(args: argparse.Namespace, stub: pb_grpc.TrainingStub, md: list[tuple[str, str]]) -> int:
    if args.command == "submit":
        extra = list(args.args)
        if extra and extra[0] == "--":
            extra = extra[1:]
        request = pb.TrainRequest(name=args.name, entry_point=args.entry_point, args=extra,
                                  dataset=args.dataset, framework=args.framework,
                                  processes_per_worker=max(args.processes_per_worker, 0),
                                  timeout_s=args.timeout, restarts=max(args.restarts, 0))
        if args.processes_per_worker < 1:
            raise SystemExit("plait jobs: error: invalid --processes-per-worker="
                             f"{args.processes_per_worker}: expected an integer >= 1")
        request.parameters.update(_parameters(args))
        reply = stub.Train(request, metadata=md)
        _print(reply, args.json, reply.job_id)
        if args.wait:
            status = _wait(stub, reply.job_id, md)
            _print(status, args.json, format_status(status))
            return 0 if status.state == pb.SUCCEEDED else 1
        return 0
    if args.command == "status":
        status = stub.GetTrainingStatus(pb.StatusRequest(job_id=args.job_id), metadata=md)
        if args.wait:
            status = _wait(stub, args.job_id, md)
        _print(status, args.json, format_status(status))
        return 0 if not args.wait or status.state == pb.SUCCEEDED else 1
    if args.command == "list":
        reply = stub.ListJobs(pb.ListJobsRequest(states=[pb.JobState.Value(s.upper()) for s in args.state]),
                              metadata=md)
        rows = [f"{j.job_id}  {_state(j.state):9}  {j.framework:10}  {j.instances}x{j.processes_per_worker}  "
                f"{j.name}" for j in reply.jobs]
        _print(reply, args.json, "\n".join(rows) if rows else "(no jobs)")
        return 0
    if args.command == "cancel":
        status = stub.Cancel(pb.CancelRequest(job_id=args.job_id), metadata=md)
        _print(status, args.json, format_status(status))
        return 0
    out = sys.stdout.buffer
    for chunk in stub.Logs(pb.LogsRequest(job_id=args.job_id, rank=max(args.rank, 0), follow=args.follow),
                           metadata=md):
        out.write(chunk.data)
        out.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``plait jobs``.

    Returns:
        0 on success, 1 when the service answered with an error (or a waited-for job did not
        succeed), 2 on bad usage.
    """
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    token = os.environ.get("PLAIT_SERVICE_TOKEN", "")
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    md = [("authorization", f"Bearer {token}")] if token else []
    if getattr(args, "rank", 0) < 0:
        print(f"plait jobs: error: invalid --rank={args.rank}: expected an integer >= 0", file=sys.stderr)
        return 2
    with grpc.insecure_channel(args.server) as channel:
        stub = pb_grpc.TrainingStub(channel)
        try:
            return _run(args, stub, md)
        except grpc.RpcError as exc:
            code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
            details = exc.details() if hasattr(exc, "details") else str(exc)
            print(f"plait jobs: error: {code}: {details}", file=sys.stderr)
            return 1
        except SystemExit as exc:
            print(exc.code, file=sys.stderr)
            return 2
        except BrokenPipeError:  # e.g. piped into head
            return 0
