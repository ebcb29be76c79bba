"""A task's error is sorted by its type, never by its text or its class's name (``workers/causes.py``)."""

from __future__ import annotations

from hsx.errors import StoreError
from workers.causes import PARK, TRANSIENT, UNKNOWN, classify


def test_torch_s_out_of_memory_is_transient_by_type_and_a_look_alike_is_not():
    import torch

    assert classify(torch.OutOfMemoryError("CUDA out of memory")) == TRANSIENT
    assert classify(torch.cuda.OutOfMemoryError("CUDA out of memory")) == TRANSIENT

    class OutOfMemoryError(Exception):  # another library's class of the same name
        pass

    assert classify(OutOfMemoryError("out of memory")) == UNKNOWN
    assert classify(RuntimeError("CUDA out of memory")) == UNKNOWN, "the text decides nothing"


def test_the_same_text_sorts_by_the_error_s_type_and_flags():
    text = "s3://b/run: the store did not answer"
    assert classify(StoreError(text, transient=True)) == TRANSIENT
    assert classify(StoreError(text)) == PARK
    assert classify(ValueError(text)) == UNKNOWN
