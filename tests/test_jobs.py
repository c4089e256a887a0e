"""Real multi-process jobs: every rank runs a pytest file under mpirun or horovodrun.

Each job is one launch (the import cost of torch/TensorFlow is paid once per
rank), its own timeout, and fails if any rank fails.
"""

from __future__ import annotations

import pytest
from jobs import pytest_argv, run_job

# horovod.tensorflow as the library, under horovodrun --mpi; only the Horovod backend: the MPI
# backend's cases of the same files already run under mpirun (a TensorFlow job costs ~30 s each).
# job_dp_tf under mpirun runs only the MPI backend: its Horovod cases run under horovodrun with
# horovod.tensorflow, the library a TensorFlow script uses.
HVD_TF = {"PLAIT_TEST_HOROVOD_FRAMEWORK": "tensorflow", "PLAIT_TEST_BACKENDS": "horovod"}
# (ids show the env values: "-tensorflow" means that library, "-mpi"/"-horovod" the world backend)

JOBS = [
    ("mpirun", 2, "job_collectives.py", {}),
    ("mpirun", 3, "job_collectives.py", {}),
    ("mpirun", 2, "job_ring.py", {}),
    ("mpirun", 3, "job_ring.py", {}),
    ("mpirun", 4, "job_ring.py", {}),
    ("horovodrun-gloo", 2, "job_collectives.py", {}),
    ("horovodrun-mpi", 2, "job_collectives.py", HVD_TF),
    ("mpirun", 2, "job_dp_torch.py", {}),
    ("mpirun", 3, "job_dp_torch.py", {}),
    ("horovodrun-gloo", 2, "job_dp_torch.py", {}),
    ("horovodrun-gloo", 2, "job_hvd_reset.py", {"PLAIT_BACKEND": "horovod", "PLAIT_BUCKET_MB": "0"}),
    ("horovodrun-gloo", 2, "job_hvd_peer_death.py", {"PLAIT_BACKEND": "horovod"}),
    ("horovodrun-gloo", 2, "job_tf_graph_gloo.py", {"PLAIT_BACKEND": "horovod"}),
    ("mpirun", 2, "job_compression.py", {}),
    ("mpirun", 2, "job_dp_tf.py", {"PLAIT_TEST_BACKENDS": "mpi"}),
    ("mpirun", 2, "job_faces.py", {"PLAIT_BACKEND": "mpi"}),
    ("mpirun", 2, "job_faces.py", {"PLAIT_BACKEND": "horovod"}),
    ("mpirun", 2, "job_face_extras.py", {"PLAIT_BACKEND": "mpi"}),
    ("mpirun", 2, "job_face_extras.py", {"PLAIT_BACKEND": "horovod"}),
    ("mpirun", 2, "job_tf_faces_extra.py", {"PLAIT_BACKEND": "mpi"}),
    # 3 ranks: the ranks' graph collectives once overlapped there (backward with forward)
    ("mpirun", 3, "job_tf_faces_extra.py", {"PLAIT_BACKEND": "mpi"}),
    ("mpirun", 3, "job_tf_faces_extra.py", {"PLAIT_BACKEND": "horovod"}),
    ("horovodrun-mpi", 2, "job_dp_tf.py", HVD_TF),
]


def _id(job: tuple[str, int, str, dict[str, str]]) -> str:
    launcher, np, file, env = job
    tag = "".join(f"-{v}" for v in env.values())
    return f"{file[4:-3]}-{launcher}-np{np}{tag}"


@pytest.mark.parametrize(("launcher", "np", "job", "env"), JOBS, ids=[_id(j) for j in JOBS])
def test_job_passes_on_every_rank(launcher, np, job, env):
    result = run_job(launcher, np, pytest_argv(job), timeout=900, env=env)
    assert result.returncode == 0, result.tail(120)


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun-gloo"])
def test_one_failing_rank_fails_the_job(launcher):
    result = run_job(launcher, 2, pytest_argv("job_fails_on_last_rank.py"), timeout=300)
    assert result.returncode != 0, result.tail()
    assert "the last rank fails on purpose" in result.output
