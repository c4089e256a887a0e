"""Training with every compressor x framework (each cell on one backend, the backends taking
turns) under mpirun -np 2 (tests/parallel/job_compression_training.py): accuracy within 2 points of
uncompressed training, identical replicas, wire bytes that reflect the compression.
"""

from __future__ import annotations

from jobs import pytest_argv, run_job


def test_every_compressor_trains_digits_like_uncompressed_training():
    result = run_job("mpirun", 2, pytest_argv("job_compression_training.py"), timeout=900)
    assert result.returncode == 0, result.tail(120)
