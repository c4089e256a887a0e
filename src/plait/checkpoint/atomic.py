"""The atomic write protocol and the on-disk layout of a checkpoint directory.

Layout of ``directory``::

    latest.json                 manifest: names the latest COMPLETE checkpoint (written atomically)
    step-00000004-1a2b3c4d/     one checkpoint: its files and meta.json (sizes + sha256 of each)
    .tmp-step-00000006-.../     a checkpoint being written (never chosen; removed later)

A file is written to a temporary name in the same directory, flushed, fsynced
and renamed over its final name; then the directory is fsynced. A checkpoint is
written as a temporary directory renamed into place only when every file and
its ``meta.json`` are on disk; the manifest is updated after that. A crash at
any point leaves the manifest naming the previous complete checkpoint.
Only JSON and raw bytes are read here: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from plait.errors import PlaitError

__all__ = [
    "FORMAT",
    "MANIFEST",
    "META",
    "CheckpointError",
    "Entry",
    "atomic_write",
    "fsync_dir",
    "list_complete",
    "prune",
    "read_checkpoint",
    "read_manifest",
    "write_checkpoint",
]

#: Version of the layout; a checkpoint with another format is refused.
FORMAT = 1
#: Name of the manifest file.
MANIFEST = "latest.json"
#: Name of the per-checkpoint description file.
META = "meta.json"
_NAME = re.compile(r"step-(\d{8,})-[0-9a-f]{8}\Z")
_FILE = re.compile(r"[A-Za-z0-9_.-]+\Z")


class CheckpointError(PlaitError, RuntimeError):
    """A checkpoint is missing, corrupt or incompatible; the message names the file and why."""


@dataclass(frozen=True)
class Entry:
    """One complete checkpoint on disk.

    Attributes:
        name: its directory name inside the checkpoint directory.
        step: the training step it holds (the step to continue from).
    """

    name: str
    step: int


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and creations inside it are durable.

    Args:
        path: the directory.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically: temp file in the same dir, fsync, rename, fsync dir.

    Args:
        path: the final file name.
        data: its whole content.
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".tmp-{os.path.basename(path)}-{uuid.uuid4().hex[:8]}")
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_checkpoint(
    directory: str, step: int, files: Mapping[str, bytes], meta: Mapping[str, Any], keep: int
) -> Entry:
    """Write one checkpoint atomically, point the manifest at it, keep the newest ``keep``.

    Args:
        directory: the checkpoint directory (created if needed).
        step: the step to continue from when this checkpoint is restored.
        files: file name -> content (names of letters, digits, ``_.-``).
        meta: JSON-serialisable description (framework, world size, ...).
        keep: how many checkpoints to keep (older ones are deleted after the manifest moved on).

    Returns:
        The new entry.
    """
    os.makedirs(directory, exist_ok=True)
    name = f"step-{step:08d}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(directory, f".tmp-{name}")
    os.mkdir(tmp)
    described = {}
    for fname, data in files.items():
        if not _FILE.match(fname) or fname == META:
            raise CheckpointError(f"bad checkpoint file name {fname!r}")
        _write_synced(os.path.join(tmp, fname), data)
        described[fname] = {"bytes": len(data), "sha256": _sha256(data)}
    record = {"format": FORMAT, "step": int(step), "files": described, "meta": dict(meta)}
    _write_synced(os.path.join(tmp, META), json.dumps(record, sort_keys=True).encode())
    fsync_dir(tmp)
    os.rename(tmp, os.path.join(directory, name))
    fsync_dir(directory)
    entry = Entry(name, int(step))
    history = [e for e in list_complete(directory) if e.name != name]
    manifest = {"format": FORMAT, "latest": name, "step": int(step),
                "history": [e.name for e in history[-(keep - 1):]] if keep > 1 else []}
    atomic_write(os.path.join(directory, MANIFEST), json.dumps(manifest, sort_keys=True).encode())
    prune(directory, keep)
    return entry


def list_complete(directory: str) -> list[Entry]:
    """Complete checkpoints in ``directory`` (renamed into place), oldest first.

    Args:
        directory: the checkpoint directory.

    Returns:
        Entries sorted by step (then name); empty when the directory does not exist.
    """
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(directory, name, META)):
            found.append(Entry(name, int(m.group(1))))
    return sorted(found, key=lambda e: (e.step, e.name))


def read_manifest(directory: str) -> Entry | None:
    """The checkpoint the manifest names, or ``None`` when there is no manifest yet.

    Args:
        directory: the checkpoint directory.

    Returns:
        The latest complete checkpoint.

    Raises:
        CheckpointError: when the manifest is unreadable, of another format, or names a
            checkpoint that is not there.
    """
    path = os.path.join(directory, MANIFEST)
    if not os.path.exists(path):
        return None
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
        latest, step, fmt = manifest["latest"], manifest["step"], manifest["format"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path}: unreadable ({exc})") from exc
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint manifest {path}: format {fmt!r}, this plait reads {FORMAT}")
    if not isinstance(latest, str) or not _NAME.match(latest) or not isinstance(step, int):
        raise CheckpointError(f"checkpoint manifest {path}: bad entry latest={latest!r} step={step!r}")
    if not os.path.isdir(os.path.join(directory, latest)):
        raise CheckpointError(f"checkpoint manifest {path}: names {latest!r}, which does not exist")
    return Entry(latest, step)


def read_checkpoint(directory: str, entry: Entry) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Read and verify every file of one checkpoint.

    Args:
        directory: the checkpoint directory.
        entry: which checkpoint.

    Returns:
        ``(files, meta)``: file name -> bytes, and the ``meta`` given at writing.

    Raises:
        CheckpointError: naming the file, when one is missing, truncated, altered
            (sha256 mismatch) or of another format.
    """
    folder = os.path.join(directory, entry.name)
    meta_path = os.path.join(folder, META)
    try:
        with open(meta_path, "rb") as f:
            record = json.loads(f.read())
        fmt, step, described, meta = record["format"], record["step"], record["files"], record["meta"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {meta_path}: unreadable ({exc})") from exc
    if fmt != FORMAT:
        raise CheckpointError(f"checkpoint {meta_path}: format {fmt!r}, this plait reads {FORMAT}")
    if step != entry.step:
        raise CheckpointError(f"checkpoint {meta_path}: holds step {step}, its name says {entry.step}")
    files = {}
    for fname, info in described.items():
        path = os.path.join(folder, fname)
        if not _FILE.match(fname):
            raise CheckpointError(f"checkpoint {meta_path}: bad file name {fname!r}")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path}: cannot be read ({exc})") from exc
        if len(data) != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {path}: {len(data)} bytes, expected {info['bytes']} (truncated?)")
        if _sha256(data) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {path}: sha256 mismatch (corrupt)")
        files[fname] = data
    return files, dict(meta)


def prune(directory: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints and leftover temporaries.

    The checkpoint the manifest names is never deleted.

    Args:
        directory: the checkpoint directory.
        keep: how many complete checkpoints to keep (>= 1).

    Returns:
        The names deleted.
    """
    try:
        latest = read_manifest(directory)
    except CheckpointError:
        return []  # do not delete anything next to a manifest we cannot read
    complete = list_complete(directory)
    kept = {e.name for e in complete[-keep:]}
    if latest is not None:
        kept.add(latest.name)
    gone = []
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        stale_tmp = name.startswith(".tmp-")
        if (stale_tmp or _NAME.match(name)) and name not in kept:
            if stale_tmp and name.startswith(".tmp-step-") and _is_newest_tmp(name, complete):
                continue  # may be a checkpoint being written right now by another process
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            elif not name.startswith(f".tmp-{MANIFEST}"):
                try:
                    os.unlink(path)
                except OSError:
                    pass
            gone.append(name)
    return gone


def _is_newest_tmp(name: str, complete: list[Entry]) -> bool:
    m = re.match(r"\.tmp-step-(\d+)-", name)
    return m is not None and (not complete or int(m.group(1)) > complete[-1].step)
