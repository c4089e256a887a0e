"""context() from each launcher's environment; torch_env and tf_config."""

from __future__ import annotations

import json

import pytest

from plait.errors import ConfigError
from plait.launch.context import (
    JobContext,
    context,
    export_framework_env,
    framework_env,
    tf_config,
    torch_env,
)


def test_single_process_when_no_launcher() -> None:
    assert context({"HOME": "/root"}) == JobContext(0, 1, 0, 1, 0, 1, "single")


def test_open_mpi() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
    }
    assert context(env) == JobContext(5, 8, 1, 2, 2, 4, "openmpi")


def test_mpich_hydra() -> None:
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert context(env) == JobContext(3, 4, 1, 2, 1, 2, "mpich")


def test_horovodrun_gloo_wins_over_mpi_variables() -> None:
    env = {
        "HOROVOD_RANK": "2",
        "HOROVOD_SIZE": "6",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "3",
        "HOROVOD_CROSS_RANK": "0",
        "HOROVOD_CROSS_SIZE": "2",
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "1",
    }
    assert context(env) == JobContext(2, 6, 0, 3, 0, 2, "horovodrun")


def test_torchrun() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "node1",
    }
    assert context(env) == JobContext(3, 4, 1, 2, 1, 2, "torchrun")


def test_torchrun_without_group_variables() -> None:
    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    assert context(env) == JobContext(2, 4, 0, 2, 1, 2, "torchrun")


def test_mpirun_inside_slurm_allocation_is_open_mpi() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "4",
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert context(env).launcher == "openmpi"


def test_slurm_srun() -> None:
    env = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
    }
    assert context(env) == JobContext(6, 7, 0, 1, 3, 4, "slurm")


def test_slurm_without_tasks_per_node() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
    }
    assert context(env) == JobContext(3, 4, 1, 2, 1, 2, "slurm")


def test_bad_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="OMPI_COMM_WORLD_SIZE='four'.*an integer"):
        context({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "four"})


def test_inconsistent_values_are_rejected() -> None:
    with pytest.raises(ConfigError, match=r"rank=4.*\[0, size=4\)"):
        context({"PMI_RANK": "4", "PMI_SIZE": "4"})


def test_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert context().rank == 1


def test_torch_env() -> None:
    ctx = JobContext(3, 4, 1, 2, 1, 2, "openmpi")
    assert torch_env(ctx, "node1", 29500) == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29500",
    }
    # round trip: what torchrun would have set reads back as the same place in the job
    back = context(torch_env(ctx, "node1", 29500))
    assert (back.rank, back.size, back.local_rank, back.local_size) == (3, 4, 1, 2)


@pytest.mark.parametrize(("addr", "port"), [("", 1), ("node1", 0), ("node1", 70000), ("a b", 1)])
def test_torch_env_rejects_bad_master(addr: str, port: int) -> None:
    with pytest.raises(ConfigError, match="master_"):
        torch_env(JobContext(0, 1, 0, 1, 0, 1, "single"), addr, port)


def test_tf_config() -> None:
    workers = ["node1:12345", "node2:12345"]
    config = json.loads(tf_config(workers, 1))
    assert config == {
        "cluster": {"worker": workers},
        "task": {"type": "worker", "index": 1},
    }


@pytest.mark.parametrize(
    ("workers", "index", "fragment"),
    [
        ([], 0, "workers"),
        (["node1"], 0, "workers='node1'"),
        (["node1:x"], 0, "workers"),
        (["a:1", "a:1"], 0, "distinct"),
        (["a:1", "b:1"], 2, r"index=2.*\[0, 2\)"),
    ],
)
def test_tf_config_rejects(workers: list[str], index: int, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        tf_config(workers, index)


def test_framework_env_torch_uses_rank_zeros_endpoint() -> None:
    ctx = JobContext(1, 2, 0, 1, 1, 2, "openmpi")
    env = framework_env("torch", ctx, ["10.0.0.1", "10.0.0.2"], [29500, 29600])
    assert env == torch_env(ctx, "10.0.0.1", 29500)


def test_framework_env_tensorflow_lists_every_rank() -> None:
    ctx = JobContext(2, 3, 0, 1, 2, 3, "horovodrun")
    env = framework_env("tensorflow", ctx, ["a", "b", "c"], [1, 2, 3])
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"worker": ["a:1", "b:2", "c:3"]},
        "task": {"type": "worker", "index": 2},
    }


@pytest.mark.parametrize(
    ("framework", "addresses", "ports", "fragment"),
    [
        ("jax", ["a"], [1], "framework='jax'.*torch, tensorflow"),
        ("torch", ["a", "b"], [1], r"ports=\[1\].*2 entries"),
        ("tensorflow", "ab", [1, 2], "addresses='ab'"),
    ],
)
def test_framework_env_rejects(framework: str, addresses: list[str], ports: list[int],
                               fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        framework_env(framework, JobContext(0, 2, 0, 1, 0, 2, "openmpi"), addresses, ports)


def test_export_framework_env_rejects_unknown_framework_before_anything_else() -> None:
    with pytest.raises(ConfigError, match="framework='mxnet'"):
        export_framework_env("mxnet")
