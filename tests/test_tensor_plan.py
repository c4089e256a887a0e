"""Single-process checks of the tensor-parallel front end (the layers run in tests/parallel/job_tensor.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from plait.errors import ConfigError, PlaitTypeError
from plait.parallel.tensor import ChannelSplit, Colwise, Rowwise, Style, TensorParallel, VocabParallel
from plait.parallel.tensor.mappings import autograd_for


def test_styles_carry_their_options():
    assert Colwise().gather_output is False and Colwise(gather_output=True).gather_output
    assert Rowwise().input_is_parallel and not Rowwise(input_is_parallel=False).input_is_parallel
    assert ChannelSplit().gather_output
    assert {s.kind for s in (Colwise(), Rowwise(), VocabParallel(), ChannelSplit())} == {
        "colwise", "rowwise", "vocab", "channels"}


@pytest.mark.parametrize("plan", [{}, None, {"fc1": "colwise"}, {"fc1": Style()}, {1: Colwise()}])
def test_bad_plans_are_rejected_naming_the_entry(plan):
    with pytest.raises(ConfigError, match="plan"):
        TensorParallel(plan)  # type: ignore[arg-type]


def test_unsupported_model_type_is_named():
    with pytest.raises(PlaitTypeError, match="cannot shard a builtins.dict"):
        TensorParallel({"fc1": Colwise()}).apply({"fc1": None})


def test_numpy_has_no_autograd():
    with pytest.raises(NotImplementedError, match="numpy"):
        autograd_for("numpy")


def test_importing_the_tensor_package_imports_no_framework():
    code = ("import sys, plait.parallel.tensor, plait.parallel.tensor.plan; "
            "print(sorted(m for m in ('torch', 'tensorflow', 'keras', 'mpi4py', 'horovod') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
