"""A serialised shard (hsx.shard.serialize_shard), written to the spool or streamed into a store, is a file that safetensors reads back bit for bit."""

from __future__ import annotations

import hashlib

import torch
from safetensors import safe_open

from hsx.shard import serialize_shard
from hsx.store import LocalStore
from workers.spool import write_shard


def test_streamed_shards_read_back_identically_with_their_metadata_and_hash(tmp_path):
    """Every dtype the shard schema uses, odd sizes included: safe_open returns equal tensors; the hash is the file's."""
    g = torch.Generator().manual_seed(0)
    tensors = {
        "hidden_states": torch.randn(37, 5, 24, generator=g).to(torch.bfloat16),
        "final_postnorm": torch.randn(37, 24, generator=g),
        "input_ids": torch.randint(0, 150_000, (37,), generator=g, dtype=torch.int32),
        "loss_mask": torch.randint(0, 2, (37,), generator=g, dtype=torch.uint8),
        "cu_seqlens": torch.tensor([0, 3, 37], dtype=torch.int64),
        "sample_index": torch.tensor([4, 1], dtype=torch.int64),
        "scales": torch.randn(37, 5, generator=g).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "s.safetensors"
    nbytes, sha = write_shard(path, serialize_shard(tensors, {"run_id": "r", "layer_ids": "[1, 2]"}))
    data = path.read_bytes()
    assert nbytes == len(data) and sha == hashlib.sha256(data).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"run_id": "r", "layer_ids": "[1, 2]"}
        assert set(f.keys()) == set(tensors)
        for name, want in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name


def test_a_non_contiguous_tensor_is_written_in_logical_order(tmp_path):
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()  # a transposed view
    write_shard(tmp_path / "t.safetensors", serialize_shard({"x": x}, {}))
    with safe_open(str(tmp_path / "t.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("x"), x)


def test_a_shard_streamed_into_a_local_store_is_the_same_file_as_the_spools(tmp_path):
    """Store.write_stream of the same pieces gives the same bytes and sha256 as the spool writer, and safe_open reads it."""
    g = torch.Generator().manual_seed(1)
    tensors = {"hidden_states": torch.randn(300, 3, 64, generator=g).to(torch.bfloat16),
               "input_ids": torch.arange(300, dtype=torch.int32)}
    pieces = serialize_shard(tensors, {"batch": "b1"})
    spooled = write_shard(tmp_path / "a.safetensors", pieces)
    store = LocalStore(tmp_path / "store")
    assert store.write_stream("shards/b1-x.safetensors", pieces) == spooled
    assert store.read("shards/b1-x.safetensors") == (tmp_path / "a.safetensors").read_bytes()
    with safe_open(str(store.local_path("shards/b1-x.safetensors")), framework="pt") as f:
        assert torch.equal(f.get_tensor("hidden_states"), tensors["hidden_states"])
