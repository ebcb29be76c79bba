"""Targets of other families through the whole process stack: the MoE models people train drafters for.

The capture path is checked on every family of ``tests/tinymodels.py`` in ``test_capture.py`` (one
batched forward against each sample's own). Here a tiny checkpoint of a family whose attention differs
most from Qwen's runs through ``producer run``, the embedded broker and a Celery worker on the CPU, as a
user's ``--model DIR`` does: gpt-oss (sliding-window and full layers, attention sinks, clamped SwiGLU
experts) and DeepSeek-V3 (multi-head latent attention, a dense first layer, grouped sigmoid routing).
Each stored sample equals the sample's own forward, at every layer asked for and after the final norm.
"""

from __future__ import annotations

import pytest
import torch

from jobfixtures import assert_matches_reference, clean_env, cli_json, read_samples, run_cli
from tinymodels import tiny_checkpoint

from hsx.runconfig import load_run
from hsx.store import open_store

LAYERS = [0, 2, 5]  # of 6: the first, a middle one (gpt-oss: a full-attention layer), the last


@pytest.mark.parametrize("family", ["gpt-oss", "deepseek-v3"])
def test_producer_run_extracts_a_moe_family_as_its_own_forward_gives_it(family, tmp_path, tiny_cache):
    from transformers import AutoModelForCausalLM

    checkpoint = tiny_checkpoint(family, tmp_path / family)
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool", device="cpu")
    report = cli_json(run_cli("producer", [
        "run", "sharegpt", "--limit", "8", "--max-length", "400", "--batch-tokens", "1024", "--store-dtype", "float32",
        "--layers", ",".join(map(str, LAYERS)), "--final", "postnorm", "--model", str(checkpoint),
        "--output", str(tmp_path / "out"), "--json"], env, timeout_s=600))
    assert report["batches_done"] == report["batches_total"] >= 2, report
    run_store = open_store(report["address"])
    recorded = load_run(run_store).model
    assert (recorded.model_type, recorded.num_layers) == ({"gpt-oss": "gpt_oss", "deepseek-v3": "deepseek_v3"}[family], 6)
    samples = read_samples(run_store)
    assert len(samples) == report["plan"]["samples"] >= 6, (len(samples), report["plan"])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    assert assert_matches_reference(model, samples, LAYERS, atol=1e-4, rtol=1e-4) > 100_000
