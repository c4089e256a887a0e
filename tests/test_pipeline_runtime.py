"""Single-process tests of the pipeline runtime's pure parts: tags, wire headers, model type."""

from __future__ import annotations

import numpy as np
import pytest

from plait.parallel.pipeline import PipelineError, PipelineTypeError, framework_of
from plait.parallel.pipeline.runtime import MAX_TAG, _header, _template, check_tags, message_tag


def test_tags_are_unique_per_family_stage_and_microbatch():
    v, m = 4, 6
    tags = [message_tag(f, s, mb, v, m) for f in range(3) for s in range(v) for mb in range(m)]
    assert len(set(tags)) == len(tags)
    assert min(tags) >= 1 and max(tags) <= MAX_TAG


def test_too_many_tags_is_an_error_naming_both_counts():
    check_tags(8, 1000)
    with pytest.raises(PipelineError, match="microbatches=2000, stages=8"):
        check_tags(8, 2000)


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64", "float16"])
@pytest.mark.parametrize("shape", [(3,), (4, 5), (2, 3, 4, 5)])
def test_header_round_trip(dtype, shape):
    a = np.zeros(shape, dtype=dtype)
    t = _template(_header(a))
    assert t.shape == a.shape and t.dtype == a.dtype


def test_header_rejects_unsupported_activations():
    with pytest.raises(PipelineError, match="at most 8 dims"):
        _header(np.zeros((1,) * 9, dtype=np.float32))
    with pytest.raises(PipelineError, match="dtype must be one of"):
        _header(np.zeros(3, dtype=np.complex64))


def test_framework_of_rejects_other_models():
    with pytest.raises(PipelineTypeError, match="torch.nn.Sequential, a keras.Sequential"):
        framework_of({"fc": 1})
    with pytest.raises(PipelineTypeError):
        framework_of([object()])
