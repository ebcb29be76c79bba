"""Layer ids read from a draft model's config, and DFlash with K draft layers."""

from __future__ import annotations

import json

import pytest

from hsx.errors import BadConfig
from hsx.layers import dflash_layer_ids, layer_ids_from_draft_config, select_layers


def _write(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_dflash_target_layer_ids_are_read_from_a_nested_section(tmp_path):
    """DFlash's `dflash_config.target_layer_ids` are taken as they are (output-of convention)."""
    ids, source = layer_ids_from_draft_config(_write(tmp_path, {"dflash_config": {"target_layer_ids": [1, 16, 31, 46, 61]}}))
    assert ids == [1, 16, 31, 46, 61]
    assert "dflash_config.target_layer_ids" in source


def test_eagle3_aux_ids_in_the_vllm_convention_are_shifted_down_by_one(tmp_path):
    """vLLM's EAGLE-3 default [2, N//2, N-3] on 36 layers is SpecForge's [1, 17, 32]."""
    ids, _ = layer_ids_from_draft_config(_write(tmp_path, {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}), convention="vllm")
    assert ids == [1, 17, 32]


def test_a_draft_config_without_layer_ids_is_refused_with_the_keys_looked_for(tmp_path):
    with pytest.raises(BadConfig, match="target_layer_ids"):
        layer_ids_from_draft_config(_write(tmp_path, {"hidden_size": 4096}))


def test_a_draft_config_that_does_not_exist_is_said_as_missing_and_one_that_is_not_json_as_such(tmp_path):
    with pytest.raises(BadConfig, match=r"--draft-config .*nope.json: no such file; give the draft model's config.json"):
        layer_ids_from_draft_config(str(tmp_path / "nope.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BadConfig, match=r"bad.json: cannot read it as JSON"):
        layer_ids_from_draft_config(str(tmp_path / "bad.json"))


def test_dflash_with_k_draft_layers_spreads_k_ids_and_one_layer_takes_the_middle():
    assert dflash_layer_ids(64, 3) == [1, 31, 61]
    assert dflash_layer_ids(36, 1) == [18]
    assert select_layers(36, preset="dflash", dflash_layers=2).layer_ids == (1, 33)
    with pytest.raises(BadConfig):
        dflash_layer_ids(36, 0)


def _plan_with_draft_config(tmp_path, tiny_cache, draft: dict, **opts):
    from producer.planner import PlanOptions, plan_run
    from settings import Settings

    tmp_path.mkdir(parents=True, exist_ok=True)
    options = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp_path / "out"), limit=2,
                          draft_config=_write(tmp_path, draft), **opts)
    return plan_run(options, Settings(_env_file=None, cache_dir=tiny_cache)).config.layers


def test_an_eagle3_draft_config_stores_the_final_state_as_the_eagle3_preset_does(tmp_path, tiny_cache):
    """EAGLE-3 ids (``eagle_aux_hidden_state_layer_ids``) without --final: the post-norm final state too, which
    the EAGLE-3 exports need; DFlash ids (``target_layer_ids``): no final state; --final given: kept."""
    assert _plan_with_draft_config(tmp_path / "e", tiny_cache, {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}).final == "postnorm"
    assert _plan_with_draft_config(tmp_path / "d", tiny_cache, {"target_layer_ids": [1, 3, 6]}).final == "none"
    assert _plan_with_draft_config(tmp_path / "n", tiny_cache, {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]},
                                   final="none").final == "none"


def test_draft_config_ids_out_of_range_name_the_config_file(tmp_path, tiny_cache):
    with pytest.raises(BadConfig, match=r"out of range.*ids read from .*config\.json: eagle_aux_hidden_state_layer_ids"):
        _plan_with_draft_config(tmp_path, tiny_cache, {"eagle_aux_hidden_state_layer_ids": [1, 3, 9]})


def test_a_dflash_preset_with_more_draft_layers_than_the_depth_allows_names_the_count_that_fits():
    """Ids must not repeat: on 6 layers 10 draft layers cannot be spread; the error says how many can."""
    fits = max(k for k in range(1, 10) if len(set(dflash_layer_ids(6, k))) == k)
    with pytest.raises(BadConfig, match=rf"too shallow for this preset; give --dflash-layers {fits} or fewer, or pass --layers"):
        select_layers(6, preset="dflash", dflash_layers=10)
