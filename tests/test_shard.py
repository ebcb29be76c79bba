"""The shard schema (hsx/shard.py): one description of what a valid shard of a run holds.

A shard is built the way a worker builds it (``shard_metadata`` + the tensors) and checked with
``schema_problems``, from the tensors and from the safetensors header of its serialised bytes;
each kind of damage is named.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from hsx.layers import select_layers
from hsx.runconfig import LayersConfig, ModelConfig
from hsx.shard import Final, ShardSpec, StoreDtype, schema_problems, serialize_shard, shard_metadata

T, N, H = 11, 3, 8
LAYER_IDS = (1, 5)
MODEL = ModelConfig(name="m", model_type="qwen3", num_layers=6, hidden_size=H, revision="sha256:00")


def make_shard(final: Final, store_dtype: StoreDtype) -> tuple[dict, dict]:
    """(tensors, metadata) of a valid shard of T tokens, N samples, K = 2 layers of H values."""
    layers = LayersConfig.of(select_layers(6, layer_ids=list(LAYER_IDS), final=final))
    tensors = {"input_ids": torch.arange(T, dtype=torch.int32), "loss_mask": torch.ones(T, dtype=torch.uint8),
               "cu_seqlens": torch.tensor([0, 4, 6, T]), "sample_index": torch.tensor([7, 2, 9])}
    for name in (("hidden_states",) + final.tensors):
        shape = (T, len(LAYER_IDS), H) if name == "hidden_states" else (T, H)
        tensors[name] = torch.randn(shape).to(store_dtype.torch_dtype)
        if store_dtype.scaled:
            tensors[name + "_scale"] = torch.ones(shape[:-1])
    return tensors, shard_metadata("run-a", "b000003", layers, MODEL, {"torch": "x"}, store_dtype=store_dtype)


def spec(final: Final, store_dtype: StoreDtype) -> ShardSpec:
    return ShardSpec("run-a", LAYER_IDS, H, final, store_dtype)


def header_of(tensors: dict, metadata: dict) -> tuple[dict, int]:
    """The safetensors header of the serialised shard and the bytes of data after it."""
    raw = b"".join(bytes(p) for p in serialize_shard(tensors, metadata))
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), len(raw) - 8 - n


@pytest.mark.parametrize("store_dtype", list(StoreDtype))
@pytest.mark.parametrize("final", list(Final))
def test_a_shard_as_the_worker_builds_it_has_no_problem_from_its_tensors_or_its_header(final, store_dtype):
    """Every final x store dtype: the tensors and the serialised header both satisfy the run's spec."""
    tensors, metadata = make_shard(final, store_dtype)
    assert schema_problems(tensors, metadata, spec(final, store_dtype), batch="b000003") == []
    header, data_bytes = header_of(tensors, metadata)
    meta = header.pop("__metadata__")
    assert schema_problems(header, meta, spec(final, store_dtype), batch="b000003", data_bytes=data_bytes) == []
    expected = spec(final, store_dtype).tensors(T, N)
    assert set(header) == set(expected) and len(expected) == 4 + (1 + len(final.tensors)) * (2 if store_dtype.scaled else 1)


def test_each_kind_of_damage_is_named():
    """A missing scale, a wrong dtype, a wrong shape, an unexpected tensor, another batch, other layer ids
    and a truncated file: one sentence each, naming the tensor or key and what was expected."""
    final, dtype = Final.BOTH, StoreDtype.FP8
    tensors, metadata = make_shard(final, dtype)
    del tensors["final_prenorm_scale"]
    assert schema_problems(tensors, metadata, spec(final, dtype)) == ["missing tensors ['final_prenorm_scale']"]

    tensors, metadata = make_shard(final, dtype)
    tensors["final_postnorm"] = tensors["final_postnorm"].float()
    tensors["hidden_states"] = tensors["hidden_states"][:, :1]
    tensors["extra"] = torch.zeros(1)
    problems = schema_problems(tensors, dict(metadata, layer_ids="[1, 4]"), spec(final, dtype), batch="b000004")
    assert problems == [
        "unexpected tensors ['extra']",
        "hidden_states has shape [11, 1, 8], expected [11, 2, 8] (T=11, N=3, K=2, H=8)",
        "final_postnorm has dtype F32, expected F8_E4M3 (store_dtype fp8)",
        "metadata batch='b000003', expected 'b000004'",
        "metadata layer_ids=[1, 4], expected [1, 5]",
    ]

    tensors, metadata = make_shard(Final.NONE, StoreDtype.BFLOAT16)
    header, data_bytes = header_of(tensors, metadata)
    meta = header.pop("__metadata__")
    problems = schema_problems(header, meta, spec(Final.NONE, StoreDtype.BFLOAT16), data_bytes=data_bytes - 2)
    assert problems == [f"tensor data ends at byte {data_bytes} of {data_bytes - 2}: the file is truncated or has trailing bytes"]
    del meta["engine"]
    assert schema_problems(header, meta, spec(Final.BOTH, StoreDtype.BFLOAT16)) == [
        "missing tensors ['final_postnorm', 'final_prenorm']", "metadata lacks ['engine']",
        "metadata final='none', expected 'both'"]


def test_the_names_are_the_strings_run_json_and_the_metadata_have_always_held():
    """The enums compare equal to, and are written as, the strings: old run.json files read the same."""
    assert [f.value for f in Final] == ["none", "postnorm", "prenorm", "both"]
    assert [d.value for d in StoreDtype] == ["bfloat16", "float32", "fp8"]
    assert json.dumps({"final": Final.BOTH, "store_dtype": StoreDtype.FP8}) == '{"final": "both", "store_dtype": "fp8"}'
    assert Final.PRENORM.tensors == ("final_prenorm",) and Final.BOTH.tensors == ("final_postnorm", "final_prenorm")
    assert [d.code for d in StoreDtype] == ["BF16", "F32", "F8_E4M3"]
