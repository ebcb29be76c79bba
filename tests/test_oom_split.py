"""The forward step's out-of-memory split (``workers/extract.py`` ``_launch``): a forward that runs out
of GPU memory halves the process's forward limit and runs the batch again in smaller forwards; a
sample alone that does not fit, or an out-of-memory on the CPU, fails the task as it came. The GPU
is a stand-in that runs out of memory above a number of padded tokens (no GPU on this machine)."""

from __future__ import annotations

import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from workers import extract


class _Activation:
    """Stands for the failed forward's activations (a weak reference tells when they are freed)."""


class _Gpu:
    """A target whose forwards run out of memory above ``fits`` padded tokens (rows x longest row)."""

    def __init__(self, fits: int, device: str = "cuda"):
        self.device = torch.device(device) if device == "cpu" else SimpleNamespace(type=device)
        self.fits, self.pad_token_id, self.max_forward_tokens = fits, 0, None
        self.launched: list[int] = []
        self.activations: list = []  # weak references to each failed forward's activations

    def launch(self, rows, selection, store_dtype=None, host_buffer=None):
        B, S, _ = rows.shape
        if B * S > self.fits:
            activations = _Activation()  # a local of this frame: alive as long as the exception's traceback
            self.activations.append(weakref.ref(activations))
            raise torch.OutOfMemoryError(f"CUDA out of memory at {B * S} padded tokens (stand-in)")
        self.launched.append(B * S)
        return SimpleNamespace(rows=B, wait=lambda: None)


@pytest.fixture(autouse=True)
def _unpinned(monkeypatch):
    # A CUDA target pins its rows; this machine has no CUDA to pin with.
    real = extract.right_padded_rows
    monkeypatch.setattr(extract, "right_padded_rows", lambda *a, pin=False, **kw: real(*a, pin=False, **kw))


def _work(target, lengths: list[int]) -> extract.Prepared:
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    plan = SimpleNamespace(cu_seqlens_N1=cu, input_ids_T=np.arange(1, cu[-1] + 1, dtype=np.int64))
    ranges, rows = extract._lay_out(plan, target, target.max_forward_tokens)
    return extract.Prepared(claimed=SimpleNamespace(plan=plan), store=None, target=target, selection=None,
                            store_dtype=SimpleNamespace(torch_dtype=None), states_per_token=1, expected_bytes=0,
                            spool=None, ranges=ranges, rows=rows)


def test_a_forward_out_of_gpu_memory_halves_the_limit_and_runs_the_batch_in_smaller_forwards():
    gpu = _Gpu(fits=20)
    work = _work(gpu, [10, 10, 10, 10])  # one forward of 40 padded tokens
    pending = extract._launch(work, SimpleNamespace(batch="b000001", buffer=None))
    assert gpu.max_forward_tokens == 20, "the process's limit, for its later batches too"
    assert work.ranges == [(0, 2), (2, 4)] and [p.rows for p in pending] == [2, 2] and gpu.launched == [20, 20]


def test_the_gpu_cache_is_emptied_after_the_failed_forwards_tensors_are_freed(monkeypatch):
    """``torch.cuda.empty_cache`` before the retry gives the failed forward's blocks back only once
    nothing holds them: called inside the ``except``, the exception's frames still held them."""
    gpu = _Gpu(fits=20)
    alive_when_emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: alive_when_emptied.append(gpu.activations[-1]() is not None))
    extract._launch(_work(gpu, [10, 10, 10, 10]), SimpleNamespace(batch="b000001", buffer=None))
    assert alive_when_emptied == [False] and gpu.launched == [20, 20]


def test_a_sample_alone_out_of_gpu_memory_fails_the_task_and_keeps_the_limit():
    gpu = _Gpu(fits=20)
    work = _work(gpu, [40])
    with pytest.raises(torch.OutOfMemoryError):
        extract._launch(work, SimpleNamespace(batch="b000001", buffer=None))
    assert gpu.max_forward_tokens is None and gpu.launched == []


def test_out_of_memory_on_the_cpu_is_raised_as_it_came():
    cpu = _Gpu(fits=20, device="cpu")
    work = _work(cpu, [10, 10, 10, 10])
    with pytest.raises(torch.OutOfMemoryError):
        extract._launch(work, SimpleNamespace(batch="b000001", buffer=None))
    assert cpu.max_forward_tokens is None and work.ranges == [(0, 4)]
