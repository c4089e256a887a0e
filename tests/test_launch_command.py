"""Launcher argv for mpirun and horovodrun, and `plait run` end to end on this machine."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from plait.errors import ConfigError
from plait.launch.command import LaunchSpec, build_command, forwarded_env_names
from plait.launch.hostfile import HostSlots
from plait.launch.run import main

JOB_TIMEOUT = 60  # seconds: hard limit for every job started here

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}
needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")


def plait_run(*args: str, timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "plait.launch.run", *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, **MPI_ENV},
    )


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["--dry-run", *args]) == 0
    return shlex.split(capsys.readouterr().out)


def test_mpirun_argv_full() -> None:
    spec = LaunchSpec(
        command=("python", "train.py", "--lr", "0.1"),
        np=4,
        hosts=(HostSlots("node1", 2), HostSlots("node2", 2)),
        backend="mpi",
        network_interface="eth1",
        timeout=30.5,
        oversubscribe=True,
        tag_output=True,
        env_vars=("MY_VAR", "SEED=3"),
    )
    env = {"PATH": "/bin", "PLAIT_LOG": "debug", "PYTHONPATH": "/src", "LD_LIBRARY_PATH": "/lib",
           "HOME": "/root", "SECRET": "x"}
    cmd = build_command(spec, env, is_root=True)
    assert cmd.env == {"PLAIT_BACKEND": "mpi"}
    assert cmd.argv == [
        "mpirun", "-np", "4", "--allow-run-as-root", "-H", "node1:2,node2:2",
        "--bind-to", "none", "--map-by", "slot", "--oversubscribe", "--timeout", "31",
        "--tag-output",
        "--mca", "btl_tcp_if_include", "eth1", "--mca", "oob_tcp_if_include", "eth1",
        "-x", "LD_LIBRARY_PATH", "-x", "PATH", "-x", "PLAIT_BACKEND", "-x", "PLAIT_LOG",
        "-x", "PYTHONPATH", "-x", "MY_VAR", "-x", "SEED=3",
        "--", "python", "train.py", "--lr", "0.1",
    ]


def test_mpirun_hostfile_and_not_root() -> None:
    spec = LaunchSpec(command=("a.out",), np=2, hostfile="/etc/hosts.mpi", mca=(("btl", "tcp"),))
    argv = build_command(spec, {}, is_root=False).argv
    assert "--allow-run-as-root" not in argv
    assert argv[:5] == ["mpirun", "-np", "2", "--hostfile", "/etc/hosts.mpi"]
    assert argv[argv.index("btl") - 1: argv.index("btl") + 2] == ["--mca", "btl", "tcp"]


def test_horovodrun_argv() -> None:
    spec = LaunchSpec(
        command=("python", "train.py"),
        hosts=(HostSlots("node1", 2), HostSlots("node2", 2)),
        launcher="horovodrun",
        backend="horovod",
        controller="gloo",
        network_interface="eth1",
        start_timeout=60,
        env_vars=("SEED=3",),
    )
    cmd = build_command(spec, {"PATH": "/bin"})
    assert cmd.argv == [
        "horovodrun", "-np", "4", "-H", "node1:2,node2:2", "--gloo",
        "--network-interfaces", "eth1", "--start-timeout", "60", "python", "train.py",
    ]
    assert cmd.env == {"PLAIT_BACKEND": "horovod", "SEED": "3"}
    assert cmd.shell().startswith("PLAIT_BACKEND=horovod SEED=3 horovodrun -np 4")


def test_horovodrun_mpi_backend_uses_mpi_controller() -> None:
    spec = LaunchSpec(command=("x",), np=2, hostfile="hf", launcher="horovodrun", backend="mpi",
                      timeout=10, oversubscribe=True)
    argv = build_command(spec).argv
    assert argv == ["horovodrun", "-np", "2", "--hostfile", "hf", "--mpi",
                    "--mpi-args", "--oversubscribe --timeout 10", "x"]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"command": ()}, "command"),
        ({"launcher": "srun"}, "launcher='srun'.*mpirun, horovodrun"),
        ({"backend": "nccl"}, "backend='nccl'.*mpi, horovod, auto"),
        ({"controller": "gloo"}, "controller='gloo'.*launcher='horovodrun'"),
        ({"launcher": "horovodrun", "backend": "mpi", "controller": "gloo"}, "mpi4py needs MPI"),
        ({"timeout": 0}, "timeout=0"),
        ({"network_interface": "eth0; ls"}, "network_interface='eth0; ls'"),
        ({"env_vars": ("1BAD",)}, "env_vars='1BAD'"),
        ({"np": 3, "hosts": (HostSlots("a", 2),)}, "-np=3"),
        ({"hosts": (HostSlots("a", 2),), "hostfile": "hf"}, "hostfile='hf'.*not both"),
        ({"timeline": ""}, "timeline=''.*file path"),
        ({"timeline": "a\nb"}, "timeline='a\\\\nb'"),
    ],
)
def test_spec_validation(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"command": ("x",), **kwargs}
    with pytest.raises(ConfigError, match=fragment):
        LaunchSpec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_timeline_reaches_every_rank(launcher: str) -> None:
    spec = LaunchSpec(command=("x",), np=2, launcher=launcher, timeline="/tmp/tl.json")
    cmd = build_command(spec, {"PATH": "/bin"})
    assert cmd.env == {"PLAIT_BACKEND": "auto", "PLAIT_TIMELINE": "/tmp/tl.json"}
    if launcher == "mpirun":  # mpirun forwards it to every host; horovodrun forwards its env
        assert cmd.argv[cmd.argv.index("PLAIT_TIMELINE") - 1] == "-x"
    assert "PLAIT_TIMELINE" not in build_command(LaunchSpec(command=("x",)), {}).env


def test_dry_run_shows_the_timeline(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    argv = dry_run(capsys, "-np", "2", "--timeline", "tl.json", "--", "x")
    assert f"PLAIT_TIMELINE={tmp_path / 'tl.json'}" in argv[:2]
    assert argv[argv.index("PLAIT_TIMELINE") - 1] == "-x"
    argv = dry_run(capsys, "--launcher", "horovodrun", "--timeline", "tl.json", "--", "x")
    assert f"PLAIT_TIMELINE={tmp_path / 'tl.json'}" in argv[: argv.index("horovodrun")]
    assert main(["--timeline", "", "--", "x"]) == 2
    assert "timeline=''" in capsys.readouterr().err


def test_forwarded_env_names() -> None:
    env = {"PLAIT_A": "1", "HOROVOD_CYCLE_TIME": "1", "PATH": "/bin", "USER": "me"}
    assert forwarded_env_names(env, ["X", "PATH"]) == ["HOROVOD_CYCLE_TIME", "PATH", "PLAIT_A", "X"]


def test_dry_run_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    argv = dry_run(capsys, "--", "python", "-c", "print(1)")
    assert argv[0] == "PLAIT_BACKEND=auto"
    assert argv[1:4] == ["mpirun", "-np", "1"]
    assert argv[-4:] == ["--", "python", "-c", "print(1)"]


def test_dry_run_np_from_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = dry_run(capsys, "-H", "a:2,b:3", "--backend", "horovod", "--", "x")
    assert argv[:4] == ["PLAIT_BACKEND=horovod", "mpirun", "-np", "5"]


def test_dry_run_hostfile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("a slots=2\nb slots=2\n")
    argv = dry_run(capsys, "--hostfile", str(hostfile), "--", "x")
    assert argv[1:6] == ["mpirun", "-np", "4", "--allow-run-as-root", "--hostfile"] or argv[
        1:5] == ["mpirun", "-np", "4", "--hostfile"]
    assert argv[argv.index("--hostfile") + 1] == str(hostfile)
    # horovodrun's hostfile reader fails on comments and bare names: plait passes -H
    hostfile.write_text("# two hosts\na slots=2\nb\n")
    argv = dry_run(capsys, "--hostfile", str(hostfile), "--launcher", "horovodrun", "--", "x")
    assert argv[1:6] == ["horovodrun", "-np", "3", "-H", "a:2,b:1"]


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-H", "a:1", "-np", "2", "--", "x"]) == 2
    assert "invalid -np=2" in capsys.readouterr().err
    assert main(["-np", "2"]) == 2
    assert "missing COMMAND" in capsys.readouterr().err
    assert main(["--backend", "nccl", "--", "x"]) == 2
    assert "invalid choice: 'nccl'" in capsys.readouterr().err


def test_missing_launcher_exit_127(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["--launcher", "horovodrun", "--", "x"]) == 127
    assert "launcher 'horovodrun' not found" in capsys.readouterr().err


@needs_mpirun
def test_exit_status_propagates() -> None:
    code = (
        "import os, sys; r = int(os.environ['OMPI_COMM_WORLD_RANK']); "
        "size = os.environ['OMPI_COMM_WORLD_SIZE']; backend = os.environ['PLAIT_BACKEND']; "
        "sys.stdout.write(f'rank {r} of {size} {backend}\\n'); sys.stdout.flush(); "
        "sys.exit(3 if r == 1 else 0)"
    )
    proc = plait_run("-np", "2", "--backend", "mpi", "--timeout", "40", "--tag-output", "--",
                     sys.executable, "-c", code)
    assert proc.returncode == 3, proc.stderr
    assert "[1,0]<stdout>:rank 0 of 2 mpi" in proc.stdout.splitlines()
    assert "[1,1]<stdout>:rank 1 of 2 mpi" in proc.stdout.splitlines()


@needs_mpirun
def test_success_is_zero_and_env_is_forwarded(tmp_path: Path) -> None:
    code = ("import os, sys; sys.stdout.write(os.environ['PLAIT_X'] + ' ' + os.environ['SEED'] + "
            "' ' + os.environ['PLAIT_TIMELINE'] + '\\n')")
    proc = subprocess.run(
        [sys.executable, "-m", "plait.launch.run", "-np", "2", "-x", "SEED=7", "--timeout", "40",
         "--timeline", "tl.json", "--tag-output", "--", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=tmp_path,
        env={**os.environ, **MPI_ENV, "PLAIT_X": "fwd"},
    )
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    timeline = tmp_path / "tl.json"
    assert lines == [f"[1,0]<stdout>:fwd 7 {timeline}", f"[1,1]<stdout>:fwd 7 {timeline}"]


@needs_mpirun
def test_timeout_returns_124() -> None:
    start = time.monotonic()
    proc = plait_run("-np", "2", "--timeout", "3", "--", "sleep", "300")
    assert proc.returncode == 124, proc.stderr
    assert "longer than --timeout=3s" in proc.stderr
    assert time.monotonic() - start < 30


@needs_mpirun
def test_sigterm_is_forwarded(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    code = (
        "import os, pathlib, time; "
        f"pathlib.Path({str(marker)!r} + os.environ['OMPI_COMM_WORLD_RANK']).touch(); "
        "time.sleep(300)"
    )
    with subprocess.Popen(
        [sys.executable, "-m", "plait.launch.run", "-np", "2", "--timeout", "60", "--",
         sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **MPI_ENV},
    ) as proc:
        deadline = time.monotonic() + 40
        while not all(Path(f"{marker}{r}").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and proc.poll() is None, "ranks did not start"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 128 + signal.SIGTERM


def test_horovodrun_tuning_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """horovodrun's tuning flags set Horovod's variables on every rank, as horovodrun sets
    them (Horovod reads them on its backend, plait on the MPI backend)."""
    monkeypatch.chdir(tmp_path)
    argv = dry_run(capsys, "-np", "2", "--timeline-filename", "hv.json", "--timeline-mark-cycles",
                   "--fusion-threshold-mb", "0.5", "--hierarchical-allreduce",
                   "--stall-check-warning-time-seconds", "30", "--", "x")
    for entry in (f"HOROVOD_TIMELINE={tmp_path / 'hv.json'}", "HOROVOD_TIMELINE_MARK_CYCLES=1",
                  "HOROVOD_FUSION_THRESHOLD=524288", "HOROVOD_HIERARCHICAL_ALLREDUCE=1",
                  "HOROVOD_STALL_CHECK_TIME_SECONDS=30"):
        assert argv[argv.index(entry) - 1] == "-x", entry
    argv = dry_run(capsys, "--launcher", "horovodrun", "--timeline-filename", "hv.json", "--", "x")
    assert f"HOROVOD_TIMELINE={tmp_path / 'hv.json'}" in argv[: argv.index("horovodrun")]
    assert not any("MARK_CYCLES" in a or "FUSION" in a for a in argv)
    assert main(["--timeline-filename", " ", "--", "x"]) == 2
    assert "--timeline-filename" in capsys.readouterr().err
    assert main(["--fusion-threshold-mb", "-1", "--", "x"]) == 2
    assert "expected a number >= 0" in capsys.readouterr().err
