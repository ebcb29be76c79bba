"""The benchmark of the regenerate path (bench/generate.py) works end to end on the CPU:
``python -m producer regenerate`` as a subprocess on real ShareGPT records with the built-in
``tiny-qwen3.5``, its generated tokens counted from the shards, and the ceilings on the same prompts
in the same call (batched ``generate``; continuous batching cannot serve a Gated DeltaNet target, and
the row says why). The continuous-batching ceilings themselves run in-process on a tiny Qwen3-8B
shape. No timing is asserted (CI machines differ); the GPU figures go to BENCHMARKS.md."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from jobfixtures import ROOT, run_bench

FIELDS = ("model", "device", "command", "max_new_tokens", "regenerate", "ours", "ceilings", "ours_over",
          "ours_whole_run_over", "prompts_as_ours", "same_checkpoint_as_ours", "attn_implementation_after")
OURS_FIELDS = ("batches", "batches_planned", "answers", "generated_tokens", "generated_tokens_in_markers",
               "steady_tok_s", "whole_run_tok_s", "in_engine_tok_s", "engines", "finish_reasons", "rows_per_batch")


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_generate", ROOT / "bench" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def shard_completion_tokens(store_root: Path) -> int:
    """Generated tokens of every answer in the run's shards, read from the store."""
    from hsx.records import read_markers
    from hsx.regen import RegeneratedConversation, parse_lines
    from hsx.store import open_store

    (run_dir,) = [p.parent for p in store_root.glob("*/run.json")]
    store = open_store(str(run_dir), create=False)
    return sum(a.completion_tokens for m in read_markers(store).values()
               for c in parse_lines(store.read(m.shard.key), RegeneratedConversation, m.shard.key) for a in c.regenerated)


@pytest.mark.timeout(240)
def test_the_generate_bench_runs_producer_regenerate_and_the_ceilings(tmp_path, tiny_cache):
    out, work = tmp_path / "generate.json", tmp_path / "w"
    run_bench("generate.py", ["--model", "tiny-qwen3.5", "--device", "cpu", "--limit", "4", "--max-new-tokens", "3",
                              "--max-length", "384", "--regen-batch-tokens", "768", "--min-window-s", "0",
                              "--workdir", str(work), "--json", str(out)], tiny_cache, timeout_s=230)
    (row,) = json.loads(out.read_text())["rows"]
    assert not [f for f in FIELDS if f not in row]
    ours = row["ours"]
    assert not [f for f in OURS_FIELDS if f not in ours]
    assert ours["returncode"] == 0 and not ours["stopped_early"]
    assert ours["batches"] == ours["batches_planned"] == ours["run_report"]["batches_done"] >= 2
    assert ours["generated_tokens"] == ours["generated_tokens_in_markers"] == shard_completion_tokens(work / "store") > 0
    assert ours["answers"] >= 1 and ours["generated_tokens"] <= 3 * ours["answers"]
    assert ours["whole_run_tok_s"] > 0 and ours["steady_tok_s"] > 0 and ours["in_engine_tok_s"] > 0
    assert ours["engines"] == {"generate": ours["batches"]}, "a Gated DeltaNet target is answered by generate"
    assert row["regenerate"]["max_new_tokens"] == 3 and row["prompts_as_ours"] and row["same_checkpoint_as_ours"]
    plain = row["ceilings"]["generate"]
    assert plain["tok_s"] > 0 and plain["batches"] == ours["batches"]
    # greedy, the same prompts: the same answer lengths as ours
    assert plain["generated_tokens"] == ours["generated_tokens"] and plain["answers_as_long_as_ours"] == ours["answers"]
    for name in ("continuous_batching", "continuous_batching_per_batch"):
        assert row["ceilings"][name]["tok_s"] is None and "linear_attention" in row["ceilings"][name]["reason"]
        assert row["ours_over"][name] is None
    assert row["ours_over"]["generate"] > 0 and row["ours_whole_run_over"]["generate"] > 0
    assert len(plain["batch_names"]) == plain["batches"] and row["ours_in_engine_over_same_batches"]["generate"] > 0
    assert ours["steady_batches"] and set(ours["steady_batches"]) <= set(plain["per_batch"])


def test_the_continuous_batching_ceilings_answer_as_generate_does():
    """The ceilings of an attention-only target (tiny Qwen3-8B shape), greedy: every prompt in one
    ``generate_batch``, the worker's call per batch and batched ``generate`` give the same answer
    lengths; a budget of 0 s measures one batch."""
    import torch

    from hsx.regen import RegenConfig
    from tinymodels import tiny_model
    from workers.generate import generate_continuous, generate_left_padded

    bench = _bench_module()
    model, cpu, regen = tiny_model("qwen3").eval(), torch.device("cpu"), RegenConfig(max_new_tokens=3)
    batches = [{"batch": "b0", "prompts": [[1, 5, 9, 30, 44], [7, 8]], "seeds": [0, 0], "ours": [3, 3]},
               {"batch": "b1", "prompts": [[10, 20, 30, 40, 50, 60, 7]], "seeds": [0], "ours": [3]}]

    def plain(prompts, seeds, warm_up=False):
        return generate_left_padded(model, prompts, seeds, regen, [2], 0)

    def continuous(prompts, seeds, warm_up=False):
        return generate_continuous(model, prompts, regen, [2], 0)

    a = bench.per_batch_ceiling("generate", plain, batches, cpu, None)
    b = bench.per_batch_ceiling("continuous_batching_per_batch", continuous, batches, cpu, None)
    c = bench.all_at_once_ceiling(model, batches, regen, [2], 0, cpu, None, None)
    assert a["batches"] == b["batches"] == c["batches"] == 2 and a["answers"] == c["answers"] == 3
    assert a["generated_tokens"] == b["generated_tokens"] == c["generated_tokens"] > 0
    assert a["answers_as_long_as_ours"] == b["answers_as_long_as_ours"] == c["answers_as_long_as_ours"]
    assert c["tok_s"] > 0 and c["in_engine_tok_s"] > 0
    assert bench.per_batch_ceiling("generate", plain, batches, cpu, 0.0)["batches"] == 1
    # ours' steady window is compared with a ceiling over the window's batches only, never over others
    assert set(a["per_batch"]) == {"b0", "b1"}
    tokens, seconds = a["per_batch"]["b1"]
    assert bench.ceiling_rate(a, ["b1"]) == tokens / seconds
    assert bench.ceiling_rate(bench.per_batch_ceiling("generate", plain, batches, cpu, 0.0), ["b0", "b1"]) is None
    assert bench.ceiling_rate(c, ["b0"]) is None and bench.ceiling_rate(a, []) is None


def test_a_checkpoint_without_a_tokenizer_gets_the_bundled_one(tmp_path):
    """bench/load.py --build writes no tokenizer: the bench copies the bundled Qwen3 one in, once;
    a vocabulary smaller than its ids is refused."""
    bench = _bench_module()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 151936}))
    assert bench.ensure_tokenizer(str(ckpt), tmp_path / "cache") is True
    assert (ckpt / "tokenizer_config.json").exists()
    assert bench.ensure_tokenizer(str(ckpt), tmp_path / "cache") is False
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 2048}))
    with pytest.raises(SystemExit, match="vocab_size 2048"):
        bench.ensure_tokenizer(str(small), tmp_path / "cache")


@pytest.mark.parametrize("enqueue", [[], ["--enqueue"]])
def test_producer_regenerate_takes_its_generation_options(enqueue, capsys, tmp_path, monkeypatch):
    """``producer regenerate --max-new-tokens N`` (what the bench runs) is not refused as a generation
    option without --regenerate (run's and enqueue's check): it goes on to read the dataset."""
    from producer.cli import main

    monkeypatch.delenv("HSX_BROKER_URL", raising=False)
    code = main(["regenerate", str(tmp_path / "none.jsonl"), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                 "--max-new-tokens", "4", "--temperature", "0.5", *enqueue])
    out = capsys.readouterr()
    text = (out.out + out.err).replace("\n", "")  # rich wraps a long path at the console's width, mid-name
    assert code == 2 and "generation option" not in text
    assert ("HSX_BROKER_URL" if enqueue else "none.jsonl") in text
