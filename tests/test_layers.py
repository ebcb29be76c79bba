"""Layer ids (hsx/layers.py): presets on the real models' layer counts, refusals, and what an id
means in the captured shard (output of decoder layer i = HF ``hidden_states[i + 1]``, vLLM id i + 1).
"""

from __future__ import annotations

import json

import pytest
import torch

from tinymodels import random_batch, real_config, reference_forward, tiny_model

from hsx.errors import BadConfig
from hsx.layers import dflash_layer_ids, eagle3_layer_ids, parse_layer_ids, select_layers
from hsx.runconfig import LayersConfig, ModelConfig
from hsx.shard import shard_metadata
from workers.capture import capture_batch


def num_layers(name: str) -> int:
    """N of the real model, read from its config.json in tests/data/configs."""
    return int(real_config(name)["num_hidden_layers"])


def test_the_real_configs_have_the_layer_counts_the_presets_are_checked_on():
    """Guard: the preset cases below use the real configs' N (64, 36, 32, 48)."""
    assert {name: num_layers(name) for name in ("qwen3.5", "qwen3", "llama-3.1", "qwen3-next")} == {
        "qwen3.5": 64, "qwen3": 36, "llama-3.1": 32, "qwen3-next": 48}


@pytest.mark.parametrize("name, dflash, eagle3", [
    ("qwen3.5", [1, 16, 31, 46, 61], [1, 31, 60]),   # Qwen3.5-27B / Qwen3.6-27B (docs/FACTS.md §1)
    ("qwen3", [1, 9, 17, 25, 33], [1, 17, 32]),      # Qwen3-8B (docs/FACTS.md §1)
    ("llama-3.1", [1, 8, 15, 22, 29], [1, 15, 28]),
    ("qwen3-next", [1, 12, 23, 34, 45], [1, 23, 44]),
])
def test_presets_on_the_real_configs_give_the_published_ids(name, dflash, eagle3):
    """DFlash: 5 ids spread from 1 to N-3; EAGLE-3: [1, N//2-1, N-4] (SpecForge), output-of convention."""
    n = num_layers(name)
    assert select_layers(n, preset="dflash").layer_ids == tuple(dflash)
    assert select_layers(n, preset="eagle3").layer_ids == tuple(eagle3)


def test_dflash_rounds_with_pythons_bankers_rounding_and_takes_the_middle_for_one_layer():
    """N=34: 1 + 30*j/4 = 8.5 and 23.5 round to 8 and 24 (round half to even); one draft layer -> N//2."""
    assert dflash_layer_ids(34) == [1, 8, 16, 24, 31]
    assert dflash_layer_ids(64, 1) == [32]
    assert eagle3_layer_ids(36) == [1, 17, 32]


def test_presets_default_final_states():
    """EAGLE-3 stores the post-norm final state by default; DFlash needs none."""
    assert select_layers(36, preset="eagle3").final == "postnorm"
    assert select_layers(36, preset="dflash").final == "none"
    assert select_layers(36).preset == "eagle3"


@pytest.mark.parametrize("kwargs, message", [
    (dict(layer_ids=[1, 2, 2]), r"layer ids \[1, 2, 2\] contain duplicates"),
    (dict(preset="eagle3"), r"--preset eagle3 on a model with 6 layers gives ids \[1, 2, 2\], which repeat"),  # N//2-1 == N-4
    (dict(layer_ids=[3, 1]), r"must be ascending .*use \[1, 3\]"),
    (dict(layer_ids=[1, 6]), r"layer ids \[6\] are out of range for a model with 6 layers.*\[0, 5\]"),
    (dict(layer_ids=[-1, 2]), r"layer ids \[-1\] are out of range"),
    (dict(layer_ids=[]), r"--layers is empty"),
    (dict(layer_ids=[1], preset="dflash"), r"either --layers or --preset, not both"),
    (dict(preset="medusa"), r"--preset 'medusa': unknown preset; choose one of eagle3, dflash"),
    (dict(layer_ids=[1], final="pre"), r"--final 'pre': choose one of none, postnorm, prenorm, both"),
])
def test_bad_layer_requests_are_refused_with_the_value_and_the_rule(kwargs, message):
    """Each refusal names the offending value and the rule (6-layer model)."""
    with pytest.raises(BadConfig, match=message):
        select_layers(6, **kwargs)


def test_layer_lists_that_are_not_integers_are_refused():
    assert parse_layer_ids("1, 16,31") == [1, 16, 31]
    with pytest.raises(BadConfig, match=r"--layers '1,x': expected comma-separated integers"):
        parse_layer_ids("1,x")
    for empty in ("", " ", ","):  # not the default preset in disguise
        with pytest.raises(BadConfig, match=r"leave --layers out for the eagle3 preset"):
            parse_layer_ids(empty)


def test_the_last_layer_with_both_final_states_is_accepted():
    """Layer N-1 plus --final both is a valid request (the pre-norm state is then the same values as slot N-1)."""
    selection = select_layers(6, layer_ids=[1, 5], final="both")
    assert selection.deepest_layer == 5 and selection.final == "both"
    assert select_layers(6, layer_ids=[1, 3], final="none").deepest_layer == 3


def test_ids_1_2_3_on_a_6_layer_model_are_hf_hidden_states_2_3_4_and_vllm_ids_2_3_4():
    """Slot j holds HF hidden_states[id_j + 1] of the sample's own forward; the shard metadata names vLLM ids [2, 3, 4]."""
    model = tiny_model("qwen3", num_layers=6)
    selection = select_layers(6, layer_ids=[1, 2, 3], final="none")
    samples, ids_T, cu = random_batch([11, 30], seed=2)
    hidden_TKH = capture_batch(model, ids_T, cu, selection, store_dtype=torch.float32).states["hidden_states"]
    assert hidden_TKH.shape == (41, 3, 64)
    for j, ids_S in enumerate(samples):
        hf = reference_forward(model, ids_S)["hidden_states"]
        for k, layer_id in enumerate([1, 2, 3]):
            got, want = hidden_TKH[cu[j]:cu[j + 1], k], hf[layer_id + 1]
            diff = (got - want).abs().max().item()
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), f"sample {j} id {layer_id}: max |diff| {diff:.3g} > 1e-5"
            # and not its neighbours: an off-by-one would match hf[layer_id] or hf[layer_id + 2]
            assert (got - hf[layer_id]).abs().max() > 0.1 and (got - hf[layer_id + 2]).abs().max() > 0.1
    model = ModelConfig(name="tiny", model_type="qwen3_5_text", num_layers=8, hidden_size=64, revision="sha256:00")
    meta = shard_metadata("run", "b000000", LayersConfig.of(selection), model, {})
    assert json.loads(meta["layer_ids"]) == [1, 2, 3]
    assert json.loads(meta["vllm_ids"]) == [2, 3, 4]
    assert json.loads(meta["hf_hidden_states_indices"]) == [2, 3, 4]
    assert meta["final"] == "none" and "output of decoder layer i, 0-based" in meta["layer_id_convention"]
