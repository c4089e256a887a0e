"""Real multi-process jobs: every rank runs a pytest file under mpirun or horovodrun.

Each job is one launch (the import cost of torch/TensorFlow is paid once per
rank), its own timeout, and fails if any rank fails.
"""

from __future__ import annotations

import pytest
from jobs import ROOT, pytest_argv, run_job

# horovod.tensorflow as the library, under horovodrun --mpi; only the Horovod backend: the MPI
# backend's cases of the same files already run under mpirun (a TensorFlow job costs ~30 s each).
# job_dp_tf under mpirun runs only the MPI backend: its Horovod cases run under horovodrun with
# horovod.tensorflow, the library a TensorFlow script uses.
HVD_TF = {"PLAIT_TEST_HOROVOD_FRAMEWORK": "tensorflow", "PLAIT_TEST_BACKENDS": "horovod"}
# (ids show the env values: "-tensorflow" means that library, "-mpi"/"-horovod" the world backend)

#: job_dp_tf's tests of collectives inside graphs (tf.function and TF1 sessions)
GRAPH_TESTS = ("tf.function or twenty or negotiated or mismatch or horovods_gradients or indexed_slices"
               " or uneven_data_and_join")
FACES = "job_faces.py job_face_extras.py job_tf_faces_extra.py"
#: job_collectives' numpy and torch flavours only: its TensorFlow flavours (half its tests, and
#: TensorFlow's import on every rank) run at 2 ranks under mpirun on both backends and under
#: horovodrun --mpi with horovod.tensorflow; a world size or a Horovod controller changes the
#: communicator's path, not the framework's conversion
NO_TF = "not tensorflow and not tf.function"

JOBS = [
    ("mpirun", 2, "job_collectives.py", {}),
    ("mpirun", 3, f"job_collectives.py -k {NO_TF}", {}),
    ("mpirun", 2, "job_ring.py", {}),
    ("mpirun", 3, "job_ring.py", {}),
    ("mpirun", 4, "job_ring.py", {}),
    ("horovodrun-gloo", 2, f"job_collectives.py -k {NO_TF}", {}),
    ("horovodrun-mpi", 2, "job_collectives.py", HVD_TF),
    ("mpirun", 2, "job_dp_torch.py", {}),
    ("mpirun", 3, "job_dp_torch.py", {}),
    ("horovodrun-gloo", 2, "job_dp_torch.py", {}),
    ("horovodrun-gloo", 2, "job_hvd_reset.py", {"PLAIT_BACKEND": "horovod", "PLAIT_BUCKET_MB": "0"}),
    ("horovodrun-gloo", 2, "job_hvd_peer_death.py", {"PLAIT_BACKEND": "horovod"}),
    ("horovodrun-gloo", 2, "job_tf_graph_gloo.py", {"PLAIT_BACKEND": "horovod"}),
    ("mpirun", 2, "job_compression.py", {}),
    ("mpirun", 2, "job_dp_tf.py", {"PLAIT_TEST_BACKENDS": "mpi"}),
    # 3 ranks: the graph tests (the ranks' executors order a graph's collectives their own
    # way; the negotiation must still pair them up)
    ("mpirun", 3, f"job_dp_tf.py -k {GRAPH_TESTS}", {"PLAIT_TEST_BACKENDS": "mpi"}),
    ("horovodrun-mpi", 2, "job_dp_tf.py", HVD_TF),
    ("horovodrun-mpi", 3, f"job_dp_tf.py -k {GRAPH_TESTS}", HVD_TF),
    # Horovod's API on plait, at 2 and 3 ranks on both backends (3 ranks once found
    # process sets whose communicators got different ids on their ranks). On the MPI
    # backend one launch runs the three files; on Horovod's they run apart: job_faces
    # imports the real horovod.tensorflow, whose import points Horovod's process sets at
    # TensorFlow's library, and then real horovod.torch's sparse_allreduce_async in
    # job_face_extras fails ("Horovod has not been initialized"), as it does in Horovod.
    ("mpirun", 2, FACES, {"PLAIT_BACKEND": "mpi"}),
    ("mpirun", 3, FACES, {"PLAIT_BACKEND": "mpi"}),
    *[("mpirun", np, file, {"PLAIT_BACKEND": "horovod"}) for file in FACES.split()[:2] for np in (2, 3)],
    # (job_tf_faces_extra at 2 ranks on Horovod's backend: job_faces' TensorFlow and Keras
    # tests run there, and job_dp_tf's graphs under horovodrun)
    ("mpirun", 3, "job_tf_faces_extra.py", {"PLAIT_BACKEND": "horovod"}),
]


def _id(job: tuple[str, int, str, dict[str, str]]) -> str:
    launcher, np, files, env = job
    tag = "".join(f"-{v}" for v in env.values())
    name = "+".join(f[4:-3] for f in files.split() if f.startswith("job_"))
    kind = {f" -k {GRAPH_TESTS}": "-graph", f" -k {NO_TF}": "-no_tf"}
    return f"{name}{''.join(v for k, v in kind.items() if files.endswith(k))}-{launcher}-np{np}{tag}"


def _argv(files: str) -> list[str]:
    """``pytest_argv`` for "job_a.py [job_b.py ...] [-k EXPR]": the files in one launch."""
    first, *rest = files.split(" -k ")[0].split()
    extra = [str(ROOT / "tests" / "parallel" / f) for f in rest]
    if " -k " in files:
        extra += ["-k", files.split(" -k ", 1)[1]]
    return pytest_argv(first, *extra)


@pytest.mark.parametrize(("launcher", "np", "job", "env"), JOBS, ids=[_id(j) for j in JOBS])
def test_job_passes_on_every_rank(launcher, np, job, env):
    result = run_job(launcher, np, _argv(job), timeout=900, env=env)
    assert result.returncode == 0, result.tail(120)


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun-gloo"])
def test_one_failing_rank_fails_the_job(launcher):
    result = run_job(launcher, 2, pytest_argv("job_fails_on_last_rank.py"), timeout=300)
    assert result.returncode != 0, result.tail()
    assert "the last rank fails on purpose" in result.output
