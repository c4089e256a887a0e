"""A job whose last rank fails one test: the whole job must fail (tests/test_jobs.py)."""

import os


def test_only_the_last_rank_fails():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("HOROVOD_SIZE", "1")))
    assert rank != size - 1, "the last rank fails on purpose"
