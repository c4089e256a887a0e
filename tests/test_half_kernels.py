"""16-bit float reductions of the MPI backend's ring: the torch adapter's vectorised kernels
(float16, bfloat16) and TensorFlow's (float16) give bit for bit what numpy's element-by-element
float16 (and plait's bfloat16) math gives."""

from __future__ import annotations

import numpy as np
import pytest
from plait.adapters.numpy import bf16_to_f32, f32_to_bf16
from plait.collectives.ring import combiner

#: (framework, a 16-bit dtype its adapter has kernels for); numpy arrays (a TensorFlow
#: graph's collectives) borrow the loaded framework's: torch's here
CASES = [("torch", "float16"), ("torch", "bfloat16"), ("tensorflow", "float16"), ("numpy", "float16"),
         ("numpy", "bfloat16")]


def _ops(framework: str):
    pytest.importorskip(framework)
    if framework == "numpy":
        pytest.importorskip("torch")
        from plait.adapters.numpy import OPS
    elif framework == "torch":
        from plait.adapters.torch import OPS
    else:
        from plait.adapters.tensorflow import OPS
    return OPS


def _values(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(5000) * 10.0 ** rng.integers(-6, 5, 5000),
                        [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0, np.inf, -np.inf]])
    return x.astype(np.float16) if dtype == "float16" else f32_to_bf16(x.astype(np.float32))


@pytest.mark.parametrize("framework,dtype", CASES)
@pytest.mark.parametrize("op", ["sum", "min", "max", "product"])
def test_host_reduce_equals_numpy(framework: str, dtype: str, op: str) -> None:
    OPS = _ops(framework)
    a, b = _values(dtype), _values(dtype)[::-1].copy()
    want, got = np.empty_like(a), np.empty_like(a)
    with np.errstate(over="ignore", invalid="ignore"):  # inf and nan are part of the check
        combiner(dtype, op)(want, a, b)
    fast = combiner(dtype, op, OPS)
    assert fast is not combiner(dtype, op)
    fast(got, a, b)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("framework,dtype", CASES)
@pytest.mark.parametrize("n", [2, 3, 7])
def test_host_divide_equals_numpy(framework: str, dtype: str, n: int) -> None:
    OPS = _ops(framework)
    x = _values(dtype)
    want = x / np.float16(n) if dtype == "float16" else f32_to_bf16(bf16_to_f32(x) / n)
    got = x.copy()
    divide = OPS.host_divide(dtype)
    assert divide is not None
    divide(got, n)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("framework", ["torch", "tensorflow", "numpy"])
def test_other_dtypes_keep_numpy(framework: str) -> None:
    OPS = _ops(framework)
    assert OPS.host_reduce("sum", "float32") is None and OPS.host_divide("int64") is None
    if framework == "tensorflow":
        assert OPS.host_reduce("sum", "bfloat16") is None
