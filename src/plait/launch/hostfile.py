"""Hostfiles and ``-H`` host lists: which hosts a job runs on, and how many ranks each.

Formats accepted (the common subset of Open MPI, Horovod and DeepSpeed)::

    # a comment; blank lines are ignored
    node1 slots=4      # 4 ranks on node1
    node2              # 1 rank (slot) on node2

and on the command line ``-H node1:4,node2`` (``HOST[:SLOTS]`` items, comma
separated). ``HOST:N`` is not accepted inside a hostfile: Open MPI would read it
as a host name. ``max_slots=M`` (or ``max-slots=M``) is accepted for Open MPI
compatibility, checked to be a positive integer, and otherwise ignored.

A host name is an IPv4 address or a host name made of letters, digits, ``-``,
``.`` and ``_`` (no leading ``-``). Anything else is rejected, shell
metacharacters with a message saying so, so a host name can never smuggle a
command or an option into the launcher.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from plait.errors import ConfigError

__all__ = [
    "HOSTFILE_FORMAT",
    "HOSTS_FORMAT",
    "HostSlots",
    "HostfileError",
    "check_np",
    "format_hosts",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_hosts",
    "total_slots",
    "validate_host",
]

#: What a hostfile line must look like; quoted in every hostfile error.
HOSTFILE_FORMAT = "'HOST slots=N' (N >= 1), 'HOST' (1 slot), a '# comment' or a blank line"
#: What a ``-H`` value must look like; quoted in every ``-H`` error.
HOSTS_FORMAT = "'HOST[:SLOTS][,HOST[:SLOTS]...]', e.g. 'node1:2,node2:2' (SLOTS >= 1)"

_HOST_RE = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})\Z")
_SHELL_META = set(" \t\r\n\v\f;&|$`'\"\\<>(){}[]*?~!#=%^,")
_MAX_SLOTS = 1 << 20


@dataclass(frozen=True)
class HostSlots:
    """One host of a job and the number of ranks (slots) it runs.

    Attributes:
        host: host name or IPv4 address.
        slots: number of ranks the host runs (>= 1).
    """

    host: str
    slots: int = 1

    def __str__(self) -> str:
        return f"{self.host}:{self.slots}"


class HostfileError(ConfigError):
    """A hostfile, ``-H`` list or ``-np`` that cannot be used.

    A ``ValueError`` (through :class:`plait.errors.ConfigError`). The message names
    the source (file name or ``-H``), the line or item number, the offending text
    and the expected format.

    Attributes:
        source: file name, ``"-H"`` or ``"-np"``.
        line: 1-based line (hostfile) or item (``-H``) number, or ``None``.
        text: the offending line or item, or ``None``.
    """

    def __init__(
        self, message: str, source: str = "", line: int | None = None, text: str | None = None
    ) -> None:
        super().__init__(message)
        self.source = source
        self.line = line
        self.text = text


def validate_host(host: str) -> str | None:
    """Say what is wrong with a host name, if anything.

    Args:
        host: a candidate host name or IPv4 address.

    Returns:
        ``None`` if ``host`` is valid, else a sentence describing the problem.
    """
    if not host:
        return "the host name is empty"
    meta = sorted({c for c in host if c in _SHELL_META})
    if meta:
        shown = " ".join(repr(c) for c in meta)
        return f"host name {host!r} contains shell metacharacter(s) {shown}, which are not allowed"
    if host.startswith("-"):
        return f"host name {host!r} starts with '-' (it would be read as an option)"
    if ":" in host:
        return (
            f"host name {host!r} contains ':' "
            "(IPv6 addresses and 'HOST:N' are not accepted here)"
        )
    if not _HOST_RE.match(host):
        return (
            f"host name {host!r} is not valid: use letters, digits, '-', '.' and '_' "
            "(at most 253 characters, no leading '-')"
        )
    if ".." in host or host.endswith("."):
        return f"host name {host!r} has an empty label (a '..' or a trailing '.')"
    return None


def _parse_slots(value: str) -> int | str:
    """Return the slot count, or a sentence saying why ``value`` is not one."""
    if not re.fullmatch(r"[+-]?[0-9]+", value.strip()) or value != value.strip():
        return f"slots must be a positive integer, got {value!r}"
    slots = int(value)
    if slots < 1:
        return f"slots must be >= 1, got {slots}"
    if slots > _MAX_SLOTS:
        return f"slots must be <= {_MAX_SLOTS}, got {slots}"
    return slots


def _check_duplicates(
    entries: Sequence[tuple[HostSlots, int, str]],
    source: str,
    locate: Callable[[int, str], str],
    what: str,
    fmt: str,
) -> None:
    seen: dict[str, int] = {}
    for entry, number, text in entries:
        if entry.host in seen:
            raise HostfileError(
                f"{locate(number, text)}: host {entry.host!r} is listed twice "
                f"(first at {what} {seen[entry.host]}); give each host once with its total "
                f"slots; expected {fmt}",
                source,
                number,
                text,
            )
        seen[entry.host] = number


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[HostSlots]:
    """Parse the contents of a hostfile.

    Args:
        text: the whole file.
        source: name used in error messages (normally the file name).

    Returns:
        The hosts in file order.

    Raises:
        HostfileError: on a malformed line, a bad host name, zero or negative
            slots, a duplicate host, or a file with no hosts.
    """
    entries: list[tuple[HostSlots, int, str]] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue

        def fail(problem: str, number: int = number, raw: str = raw) -> HostfileError:
            shown = raw.strip()
            return HostfileError(
                f"{source}:{number}: {shown!r}: {problem}; expected {HOSTFILE_FORMAT}",
                source,
                number,
                shown,
            )

        host, *options = line.split()
        head, _, tail = host.partition(":")
        if tail.isdigit() and validate_host(head) is None:
            raise fail(f"'HOST:N' is only accepted by -H; write '{head} slots={tail}' here")
        problem = validate_host(host)
        if problem is not None:
            raise fail(problem)
        slots = 1
        seen_slots = False
        for option in options:
            key, sep, value = option.partition("=")
            if key not in ("slots", "max_slots", "max-slots") or not sep:
                raise fail(f"unknown option {option!r} (only 'slots=N' is understood)")
            parsed = _parse_slots(value)
            if isinstance(parsed, str):
                raise fail(parsed)
            if key == "slots":
                if seen_slots:
                    raise fail("'slots=' is given twice")
                seen_slots, slots = True, parsed
        entries.append((HostSlots(host, slots), number, raw.strip()))
    if not entries:
        raise HostfileError(
            f"{source}: no hosts found (only comments or blank lines); expected {HOSTFILE_FORMAT}",
            source,
        )
    _check_duplicates(
        entries, source, lambda n, t: f"{source}:{n}: {t!r}", "line", HOSTFILE_FORMAT
    )
    return [entry for entry, _, _ in entries]


def parse_hostfile(path: str | os.PathLike[str]) -> list[HostSlots]:
    """Read and parse a hostfile.

    Args:
        path: the hostfile.

    Returns:
        The hosts in file order.

    Raises:
        HostfileError: if the file cannot be read or is not a valid hostfile.
    """
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostfileError(
            f"invalid --hostfile={name!r}: cannot read it ({exc}); expected a readable text "
            f"file of lines {HOSTFILE_FORMAT}",
            name,
        ) from exc
    return parse_hostfile_text(text, source=name)


def parse_hosts(spec: str, source: str = "-H") -> list[HostSlots]:
    """Parse a ``-H`` value such as ``"node1:2,node2:2"``.

    Args:
        spec: comma-separated ``HOST[:SLOTS]`` items; a bare ``HOST`` is 1 slot.
        source: the option name used in error messages.

    Returns:
        The hosts in the given order.

    Raises:
        HostfileError: on an empty list or item, a bad host name, bad slots or
            a duplicate host.
    """
    if not spec.strip():
        raise HostfileError(f"invalid {source}={spec!r}: empty; expected {HOSTS_FORMAT}", source)
    entries: list[tuple[HostSlots, int, str]] = []
    for number, item in enumerate(spec.split(","), start=1):

        def fail(problem: str, number: int = number, item: str = item) -> HostfileError:
            return HostfileError(
                f"invalid {source}={spec!r}: item {number} {item!r}: {problem}; "
                f"expected {HOSTS_FORMAT}",
                source,
                number,
                item,
            )

        host, sep, count = item.rpartition(":") if ":" in item else (item, "", "")
        problem = validate_host(host)
        if problem is not None:
            raise fail(problem)
        slots = 1
        if sep:
            parsed = _parse_slots(count)
            if isinstance(parsed, str):
                raise fail(parsed)
            slots = parsed
        entries.append((HostSlots(host, slots), number, item))
    _check_duplicates(
        entries, source, lambda n, t: f"invalid {source}={spec!r}: item {n} {t!r}", "item",
        HOSTS_FORMAT,
    )
    return [entry for entry, _, _ in entries]


def total_slots(hosts: Iterable[HostSlots]) -> int:
    """Sum the slots of ``hosts``.

    Args:
        hosts: the hosts of a job.

    Returns:
        The total number of slots.
    """
    return sum(h.slots for h in hosts)


def format_hosts(hosts: Iterable[HostSlots]) -> str:
    """Render hosts as a ``-H`` value (``"node1:2,node2:2"``).

    Args:
        hosts: the hosts of a job.

    Returns:
        The comma-separated ``HOST:SLOTS`` string.
    """
    return ",".join(str(h) for h in hosts)


def check_np(np: int, hosts: Sequence[HostSlots], oversubscribe: bool = False) -> None:
    """Check that ``np`` ranks fit on ``hosts``.

    Args:
        np: number of ranks requested.
        hosts: the hosts of the job; empty means "let the launcher decide".
        oversubscribe: allow more ranks than slots.

    Raises:
        HostfileError: if ``np < 1``, or ``np`` exceeds the total slots and
            ``oversubscribe`` is false.
    """
    if np < 1:
        raise HostfileError(f"invalid -np={np}: expected an integer >= 1", "-np")
    total = total_slots(hosts)
    if hosts and np > total and not oversubscribe:
        raise HostfileError(
            f"invalid -np={np}: the hosts ({format_hosts(hosts)}) have only {total} slot(s); "
            f"expected -np <= {total}, more slots, or --oversubscribe",
            "-np",
        )
