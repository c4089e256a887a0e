"""Hostfile and -H parsing: formats, errors that say what is wrong, and no injection."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.errors import ConfigError
from plait.launch.command import LaunchSpec, build_command
from plait.launch.hostfile import (
    HostfileError,
    HostSlots,
    check_np,
    format_hosts,
    parse_hostfile,
    parse_hostfile_text,
    parse_hosts,
    total_slots,
    validate_host,
)

REPO = Path(__file__).resolve().parents[1]


def test_openmpi_horovod_deepspeed_format() -> None:
    text = """
# cluster
node1 slots=4   # four GPUs
node-2.example.com    slots=2
10.0.0.3
worker_4 slots=1 max_slots=8
"""
    hosts = parse_hostfile_text(text, "hf")
    assert hosts == [
        HostSlots("node1", 4),
        HostSlots("node-2.example.com", 2),
        HostSlots("10.0.0.3", 1),
        HostSlots("worker_4", 1),
    ]
    assert total_slots(hosts) == 8
    assert format_hosts(hosts) == "node1:4,node-2.example.com:2,10.0.0.3:1,worker_4:1"


def test_host_slots_is_frozen() -> None:
    h = HostSlots("a", 2)
    with pytest.raises(AttributeError):
        h.slots = 3  # type: ignore[misc]
    assert str(h) == "a:2"


@pytest.mark.parametrize("name", ["localhost", "two-nodes", "four-nodes-2-slots"])
def test_shipped_hostfiles_parse(name: str) -> None:
    hosts = parse_hostfile(REPO / "hostfiles" / name)
    assert hosts
    assert all(h.slots >= 1 for h in hosts)


def test_shipped_hostfile_contents() -> None:
    assert parse_hostfile(REPO / "hostfiles" / "localhost") == [HostSlots("localhost", 2)]
    four = parse_hostfile(REPO / "hostfiles" / "four-nodes-2-slots")
    assert len(four) == 4 and total_slots(four) == 8


def test_dash_h_list() -> None:
    assert parse_hosts("a:2,b:2") == [HostSlots("a", 2), HostSlots("b", 2)]
    assert parse_hosts("a,b:3") == [HostSlots("a", 1), HostSlots("b", 3)]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("node1 slots=0\n", "slots must be >= 1, got 0"),
        ("node1 slots=-2\n", "slots must be >= 1, got -2"),
        ("node1 slots=two\n", "slots must be a positive integer, got 'two'"),
        ("node1 slots=\n", "slots must be a positive integer"),
        ("node1 cpus=2\n", "unknown option 'cpus=2'"),
        ("node1 slots=2 slots=3\n", "'slots=' is given twice"),
        ("node1:4\n", "'HOST:N' is only accepted by -H; write 'node1 slots=4'"),
        ("node;reboot slots=1\n", "shell metacharacter"),
        ("$(touch /tmp/x)\n", "shell metacharacter"),
        ("-oProxyCommand=x\n", "shell metacharacter"),
        ("-node\n", "starts with '-'"),
        ("fe80::1\n", "contains ':'"),
        ("nodé\n", "is not valid"),
        ("a..b\n", "empty label"),
    ],
)
def test_bad_lines_name_file_line_text_and_format(text: str, fragment: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text("# header\n\n" + text, "cluster.txt")
    msg = str(info.value)
    assert fragment in msg
    assert msg.startswith("cluster.txt:3: ")
    assert repr(text.strip()) in msg
    assert "expected 'HOST slots=N'" in msg
    assert info.value.line == 3 and info.value.source == "cluster.txt"
    assert isinstance(info.value, ValueError) and isinstance(info.value, ConfigError)


def test_duplicate_host_names_both_lines() -> None:
    with pytest.raises(HostfileError, match=r"hf:3: 'a slots=1': host 'a' is listed twice "
                                            r"\(first at line 1\)"):
        parse_hostfile_text("a slots=2\nb\na slots=1\n", "hf")


def test_empty_hostfile() -> None:
    with pytest.raises(HostfileError, match="no hosts found"):
        parse_hostfile_text("# nothing\n\n", "empty")


def test_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(HostfileError, match=f"invalid --hostfile='{missing}': cannot read it"):
        parse_hostfile(missing)


def test_real_file_error_has_its_path(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("good slots=1\nbad slots=0\n")
    with pytest.raises(HostfileError, match=f"^{path}:2: 'bad slots=0'"):
        parse_hostfile(path)


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("", "empty"),
        ("a:2,,b", "item 2 '': the host name is empty"),
        ("a:0", "slots must be >= 1"),
        ("a:x", "slots must be a positive integer, got 'x'"),
        ("a:2,a:1", "host 'a' is listed twice"),
        ("a;ls:2", "shell metacharacter"),
        ("a b:2", "shell metacharacter"),
    ],
)
def test_bad_dash_h(spec: str, fragment: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hosts(spec)
    assert fragment in str(info.value)
    assert f"invalid -H={spec!r}" in str(info.value)
    assert "expected 'HOST[:SLOTS]" in str(info.value)


def test_np_larger_than_slots() -> None:
    hosts = [HostSlots("a", 2), HostSlots("b", 2)]
    check_np(4, hosts)
    with pytest.raises(HostfileError, match=r"invalid -np=5: the hosts \(a:2,b:2\) have only 4 "
                                            r"slot\(s\); expected -np <= 4.*--oversubscribe"):
        check_np(5, hosts)
    check_np(5, hosts, oversubscribe=True)
    with pytest.raises(HostfileError, match="invalid -np=0"):
        check_np(0, hosts)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_any_text_parses_or_raises_hostfile_error(text: str) -> None:
    try:
        hosts = parse_hostfile_text(text, "fuzz")
    except HostfileError as exc:
        assert str(exc).startswith("fuzz")
        return
    for h in hosts:
        assert validate_host(h.host) is None and h.slots >= 1


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=60))
def test_any_dash_h_parses_or_raises_hostfile_error(spec: str) -> None:
    try:
        hosts = parse_hosts(spec)
    except HostfileError:
        return
    assert parse_hosts(format_hosts(hosts)) == hosts


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab;&|$`'\" \\()<>*?!#-.:_\n", min_size=1, max_size=30))
def test_accepted_host_is_one_argv_element(name: str) -> None:
    """Whatever survives validation reaches the launcher as one harmless argv element."""
    if validate_host(name) is not None:
        return
    argv = build_command(LaunchSpec(command=("true",), hosts=(HostSlots(name, 1),))).argv
    assert argv[argv.index("-H") + 1] == f"{name}:1"
    assert not any(c in name for c in ";&|$`'\" \\()<>*?!#\n")


def test_metacharacter_host_runs_nothing(tmp_path: Path) -> None:
    """A host name carrying a command is rejected before anything is started."""
    marker = tmp_path / "pwned"
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"node1;touch {marker} slots=1\n")
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for where in (["--hostfile", str(hostfile)], ["-H", f"a,$(touch {marker})"]):
        proc = subprocess.run(
            [sys.executable, "-m", "plait.launch.run", *where, "--timeout", "20", "--", "true"],
            capture_output=True, text=True, timeout=60, env=env,
        )
        assert proc.returncode == 2, proc.stderr
        assert "shell metacharacter" in proc.stderr
        assert not marker.exists()
