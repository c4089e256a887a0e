"""The ``plait`` command: ``plait run ...`` launches a job, ``plait info`` shows the build,
``plait serve`` runs the training service and ``plait jobs ...`` is its client."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

_USAGE = """usage: plait {run,info,serve,jobs} ...

  plait run [-np N] [-H h1:2,h2:2 | --hostfile F] [--launcher mpirun|horovodrun]
            [--backend mpi|horovod] [--timeout S] [-x VAR]... [--timeline FILE]
            [--dry-run] -- COMMAND...
  plait info        versions of plait, Python, frameworks, MPI and Horovod
  plait serve [--listen 127.0.0.1:50051] [--slots N | -H h1:2,h2:2 | --hostfile F] [--code-dir D] ...
                    the gRPC training service (needs plait[service])
  plait jobs {submit,status,list,cancel,logs} ...
                    its client: plait jobs submit --name N --framework torch --instances 2 train.py
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plait`` command.

    Args:
        argv: arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit status.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from .launch.run import main as run_main

        return run_main(rest)
    if command == "info":
        from .info import main as info_main

        return info_main(rest)
    if command in ("serve", "jobs"):
        try:
            if command == "serve":
                from .service.server import main as service_main
            else:
                from .service.client import main as service_main
        except ImportError as exc:
            print(f"plait {command}: needs grpcio, grpcio-reflection and protobuf "
                  f"(pip install 'plait[service]'): {exc}", file=sys.stderr)
            return 2
        return service_main(rest)
    print(f"plait: unknown command {command!r}: expected 'run', 'info', 'serve' or 'jobs'\n\n{_USAGE}",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
