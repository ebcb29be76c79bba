"""No silent slow path: a CUDA worker refuses a Gated DeltaNet model without the fla kernels."""

from __future__ import annotations

import pytest
import torch

from jobfixtures import tiny_cache, tiny_model  # noqa: F401

from core.errors import BadConfig
from settings import Settings
from workers.target import check_kernels, is_gdn


def test_a_gdn_model_on_cuda_without_fla_is_refused_unless_allowed(tiny_model):
    """fla is absent on CPU CI: on a (pretended) CUDA device the check refuses, and names the fix; the override lets it run."""
    assert is_gdn(tiny_model.config)
    report = check_kernels(tiny_model, torch.device("cpu"), Settings(_env_file=None))
    assert report["fla"] is False  # never installed on CPU boxes (FIELD-NOTES section 2)
    with pytest.raises(BadConfig, match="HSX_ALLOW_SLOW_KERNELS"):
        check_kernels(tiny_model, torch.device("cuda"), Settings(_env_file=None))
    assert check_kernels(tiny_model, torch.device("cuda"), Settings(_env_file=None, allow_slow_kernels=True))["fla"] is False


def test_a_dense_model_is_not_a_gdn_model(tmp_path):
    from transformers import LlamaConfig

    assert not is_gdn(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128))


def test_the_row_count_warm_up_finds_the_gated_deltanet_mixers_and_only_those():
    """The warm-up that compiles fla's per-batch-size kernels calls the GDN token mixers: the
    linear-attention layers of a Qwen3.5 shape, none of a dense model."""
    from tinymodels import tiny_model
    from workers.target import linear_attention_modules

    qwen35 = tiny_model("qwen3.5")
    layer_types = qwen35.config.get_text_config().layer_types
    assert len(linear_attention_modules(qwen35)) == layer_types.count("linear_attention") > 0
    assert linear_attention_modules(tiny_model("qwen3")) == []
