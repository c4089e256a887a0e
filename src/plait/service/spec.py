"""What a job asks for, validated before anything is queued (standard library only).

A :class:`JobSpec` is built from a ``Train`` request by :func:`make_spec`; every
bad field is a :class:`~plait.errors.ConfigError` (a ``ValueError``) naming the
field, its value and what is valid, which the server answers with
``INVALID_ARGUMENT``. The entry point must be a file inside the service's code
directory: the service runs code from there only, as an argv list, never through
a shell.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from plait.errors import ConfigError, invalid

__all__ = [
    "CapacityError",
    "FRAMEWORKS",
    "INSTANCES_KEY",
    "JobSpec",
    "make_spec",
    "resolve_entry_point",
]

#: Frameworks a job can name: the group contract the service sets up for it.
FRAMEWORKS = ("torch", "tensorflow", "horovod", "mpi", "none")
#: The parameter that holds the number of workers.
INSTANCES_KEY = "PARALLEL_INSTANCES"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
_PARAM_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}\Z")
_MAX_PARAMS = 256
_MAX_ARGS = 256
_MAX_TEXT = 4096


class CapacityError(ConfigError):
    """A job needs more slots than the service has at all (it could never start)."""


@dataclass(frozen=True)
class JobSpec:
    """A validated job.

    Attributes:
        name: a label for people.
        entry_point: absolute path of the program, inside the code directory.
        args: its arguments.
        dataset: handed to the job as ``PLAIT_DATASET``.
        parameters: hyper-parameters (strings), ``PARALLEL_INSTANCES`` included.
        framework: one of :data:`FRAMEWORKS`.
        instances: number of workers (``PARALLEL_INSTANCES``).
        processes_per_worker: processes (ranks) per worker.
        timeout_s: seconds before the job is killed; 0 for no limit.
        restarts: how many times a failed job is relaunched.
    """

    name: str
    entry_point: str
    args: tuple[str, ...] = ()
    dataset: str = ""
    parameters: dict[str, str] = field(default_factory=dict)
    framework: str = "none"
    instances: int = 1
    processes_per_worker: int = 1
    timeout_s: float = 0.0
    restarts: int = 0

    @property
    def world_size(self) -> int:
        """Number of ranks: instances x processes per worker."""
        return self.instances * self.processes_per_worker

    def argv(self) -> list[str]:
        """The command every process runs: ``python FILE ARGS`` for a ``.py`` file, else ``FILE ARGS``."""
        if self.entry_point.endswith(".py"):
            return [sys.executable, "-u", self.entry_point, *self.args]
        return [self.entry_point, *self.args]

    def to_json(self) -> str:
        """The spec as JSON (what the store keeps)."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        """Rebuild a spec written by :meth:`to_json`."""
        data = json.loads(text)
        data["args"] = tuple(data.get("args", ()))
        return cls(**data)


def _text(name: str, value: object, limit: int = _MAX_TEXT) -> str:
    if not isinstance(value, str):
        raise invalid(name, value, "a string")
    if len(value) > limit or "\0" in value:
        raise invalid(name, value[:80] + "...", f"a string of at most {limit} characters, no NUL")
    return value


def resolve_entry_point(entry_point: str, code_dir: str) -> str:
    """The absolute path of ``entry_point``, which must be a file inside ``code_dir``.

    Args:
        entry_point: a path relative to ``code_dir`` or absolute.
        code_dir: the directory the service runs code from.

    Returns:
        The real path (symbolic links resolved) of the file.

    Raises:
        ConfigError: if it is empty, lies outside ``code_dir`` (also through ``..`` or a
            link), does not exist, or is neither a ``.py`` file nor executable.
    """
    _text("entry_point", entry_point)
    if not entry_point.strip():
        raise invalid("entry_point", entry_point, "a file inside the code directory")
    root = os.path.realpath(code_dir)
    path = os.path.realpath(os.path.join(root, entry_point))
    if os.path.commonpath([root, path]) != root:
        raise invalid("entry_point", entry_point, f"a file inside the code directory {root}")
    if not os.path.isfile(path):
        raise invalid("entry_point", entry_point, f"an existing file inside the code directory {root}")
    if not path.endswith(".py") and not os.access(path, os.X_OK):
        raise invalid("entry_point", entry_point, "a '.py' file or an executable file")
    return path


def _parameters(parameters: Mapping[str, Any]) -> dict[str, str]:
    if not isinstance(parameters, Mapping):
        raise invalid("parameters", parameters, "a mapping of names to strings")
    if len(parameters) > _MAX_PARAMS:
        raise invalid("parameters", f"{len(parameters)} entries", f"at most {_MAX_PARAMS}")
    out: dict[str, str] = {}
    for key, value in parameters.items():
        if not isinstance(key, str) or not _PARAM_RE.match(key):
            raise invalid("parameters", key, "names like 'learning_rate' (letters, digits, '_', '.', '-')")
        if not isinstance(value, str):
            raise invalid(f"parameters[{key!r}]", value,
                          f"a string (e.g. {json.dumps(str(value))}): every parameter is a string")
        out[key] = _text(f"parameters[{key!r}]", value)
    return out


def _count(name: str, value: object, default: int) -> int:
    if value in (None, "", 0) and default:
        return default
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise invalid(name, value, "a whole number >= 1") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise invalid(name, value, "a whole number >= 1")
    return value


def make_spec(
    *,
    name: str,
    entry_point: str,
    code_dir: str,
    args: Sequence[str] = (),
    dataset: str = "",
    parameters: Mapping[str, Any] | None = None,
    framework: str = "none",
    processes_per_worker: int = 1,
    timeout_s: float = 0.0,
    restarts: int = 0,
    capacity: int | None = None,
) -> JobSpec:
    """Validate a request and build its :class:`JobSpec`.

    Args:
        name: a label (letters, digits, ``-``, ``_``, ``.``; at most 63).
        entry_point: the program, a file inside ``code_dir``.
        code_dir: the service's code directory.
        args: the program's arguments (strings).
        dataset: a dataset location (string).
        parameters: hyper-parameters, every value a string; ``PARALLEL_INSTANCES``
            (default ``"1"``) is the number of workers.
        framework: one of :data:`FRAMEWORKS`.
        processes_per_worker: ranks per worker (0 means 1).
        timeout_s: seconds before the job is killed (0: no limit).
        restarts: relaunch a failed job up to this many times (0..100).
        capacity: process slots the service has; ``None``: do not check.

    Returns:
        The spec.

    Raises:
        ConfigError: naming the first bad field. A job larger than ``capacity`` raises
            :class:`CapacityError` (a ``ConfigError``).
    """
    _text("name", name, 63)
    if not _NAME_RE.match(name):
        raise invalid("name", name,
                      "1 to 63 letters, digits, '_', '.' or '-', starting with a letter or digit")
    if framework not in FRAMEWORKS:
        raise invalid("framework", framework, f"one of {', '.join(FRAMEWORKS)}")
    if isinstance(args, str) or not isinstance(args, Sequence) or len(args) > _MAX_ARGS:
        raise invalid("args", args, f"a list of at most {_MAX_ARGS} strings")
    arg_list = tuple(_text(f"args[{i}]", a) for i, a in enumerate(args))
    params = _parameters(parameters or {})
    instances = _count(INSTANCES_KEY, params.get(INSTANCES_KEY, "1"), 0)
    per_worker = _count("processes_per_worker", processes_per_worker, 1)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
        0 <= timeout_s < float("inf")
    ):
        raise invalid("timeout_s", timeout_s, "seconds >= 0 (0: no limit)")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or not 0 <= restarts <= 100:
        raise invalid("restarts", restarts, "an integer in 0..100")
    path = resolve_entry_point(entry_point, code_dir)
    spec = JobSpec(name, path, arg_list, _text("dataset", dataset), params, framework, instances,
                   per_worker, float(timeout_s), restarts)
    if capacity is not None and spec.world_size > capacity:
        raise CapacityError(
            f"invalid {INSTANCES_KEY}={instances} with processes_per_worker={per_worker}: "
            f"{spec.world_size} processes, more than the service's capacity of {capacity} slots"
        )
    return spec
