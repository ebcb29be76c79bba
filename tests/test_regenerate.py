"""Regenerate runs (issue 23): ``producer run sharegpt --regenerate`` answers every planned prompt
once with the target, the same seed gives the same text, each answer's sample depends on its own
seed only, a Ctrl-C and the same command again resume, and the regenerated conversations are
extracted as a dataset. The built-in ``tiny-qwen3.5`` (random weights: its answers are noise, and
never end by themselves within 8 tokens) on real ShareGPT records, on the session's shared worker.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jobfixtures import ROOT, clean_env, cli_json, python_popen

from hsx.errors import BadDataset, BadPlan
from hsx.regen import FINISH_REASONS, RegenConfig, RegeneratedConversation, parse_lines, sample_seed
from hsx.records import SampleRow, done_batches, read_markers, read_windows
from hsx.runconfig import load_run
from hsx.store import open_store

#: 50 records; 8 new tokens per answer keep the generation at a few seconds on a CPU.
JOB = ["sharegpt", "--limit", "50", "--model", "tiny-qwen3.5", "--max-length", "384", "--batch-tokens", "1536",
       "--store-dtype", "float32", "--regenerate", "--max-new-tokens", "8", "--temperature", "0.8", "--top-k", "50",
       "--seed", "7", "--regen-batch-tokens", "1536"]


def shard_conversations(run_store) -> dict[int, RegeneratedConversation]:
    """Every regenerated conversation of a run, by sample index (a sample twice fails the test)."""
    out: dict[int, RegeneratedConversation] = {}
    for batch, marker in read_markers(run_store).items():
        for conv in parse_lines(run_store.read(marker.shard.key), RegeneratedConversation, marker.shard.key):
            assert conv.sample_index not in out, f"sample {conv.sample_index} answered twice (again in {batch})"
            out[conv.sample_index] = conv
    return out


def planned_samples(run_store) -> dict[int, str]:
    """``{sample_index: record id}`` of the run's plan."""
    return {row.sample_index: str(row.record_id) for w in read_windows(run_store)
            for row in SampleRow.read_window(run_store, w.name)}


@pytest.fixture(scope="module")
def both_stages(tmp_path_factory, tiny_cache, shared_worker):
    """``producer run ... --regenerate`` on 50 ShareGPT records: the regenerate run, then its extraction."""
    tmp = tmp_path_factory.mktemp("regenerate")
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp / "state", spool_dir=tmp / "spool")
    report = cli_json(shared_worker.producer(["run", *JOB, "--output", str(tmp / "out"), "--json"], env))
    from producer.tokenising import shared_tokenizer

    return {"tmp": tmp, "env": env, "report": report, "regen": open_store(report["regenerate"]["address"]),
            "extract": open_store(report["extract"]["address"]), "tokenizer": shared_tokenizer("tiny-qwen3.5", tiny_cache)}


def test_every_planned_prompt_is_answered_exactly_once(both_stages):
    """Each planned sample of the regenerate run has one conversation in the shards, under its record
    id, whose last message is the target's answer with its finish reason and token counts."""
    report, run_store = both_stages["report"]["regenerate"], both_stages["regen"]
    assert report["batches_done"] == report["batches_total"] > 1
    planned = planned_samples(run_store)
    assert len(planned) == report["plan"]["samples"] >= 30
    convs = shard_conversations(run_store)
    assert {i: c.id for i, c in convs.items()} == planned
    answered = [c for c in convs.values() if c.regenerated[-1].finish_reason != "prompt_too_long"]
    assert len(answered) >= 20, "most prompts fit in --max-length 384"
    for conv in answered:
        answer = conv.regenerated[-1]
        assert conv.messages[-1]["role"] == "assistant" and answer.turn == len(conv.messages) - 1
        assert answer.finish_reason in FINISH_REASONS and answer.prompt_tokens > 0
        assert 1 <= answer.completion_tokens <= 8
        assert len(conv.regenerated) == 1, "--turns last answers one turn"
    # random weights: nothing ends its turn within 8 tokens, so every answer is cut and marked so
    assert all(c.regenerated[-1].finish_reason == "length" and not c.finished for c in answered)


def test_status_of_a_regenerate_run_counts_the_generated_tokens_and_their_rate(both_stages):
    """The tokens a regenerate run planned are the conversations as given; status also says what the
    target generated (the shards' completion tokens) and gives the rate in generated tokens."""
    from rich.console import Console

    from producer.status import run_status
    from producer.statusview import status_view

    run_store = both_stages["regen"]
    status = run_status(run_store)
    completions = sum(a.completion_tokens for c in shard_conversations(run_store).values() for a in c.regenerated
                      if a.finish_reason != "prompt_too_long")
    assert status["regenerate"] is True and status["tokens_generated"] == completions > 0
    assert status["overall_generated_tokens_per_s"] < status["overall_tokens_per_s"]
    out = Console(record=True, width=200)
    out.print(status_view(status))
    text = out.export_text()
    assert "in the conversations as given" in text and f"{completions:,} tokens generated by the target" in text
    assert "generated tok/s" in text and "conversations/s" in text


def test_the_run_records_its_generation_options_and_engine(both_stages):
    """run.json holds the options (in the run id: the id differs from the extraction's of the same
    dataset), the markers name the engine: tiny-qwen3.5's Gated DeltaNet layers are not served by
    transformers' continuous batching, so the batched generate answers."""
    run_store = both_stages["regen"]
    config = load_run(run_store)
    assert RegenConfig.of(config) == RegenConfig(max_new_tokens=8, temperature=0.8, top_k=50, seed=7)
    assert config.run_id.startswith("sharegpt-regen-") and config.identity()["regenerate"]["seed"] == 7
    markers = read_markers(run_store)
    engines = {json.loads(run_store.read(f"markers/{b}.json"))["engine"] for b in markers}
    assert engines == {"generate"}


def test_the_extraction_reads_the_regenerated_conversations(both_stages):
    """The second stage's dataset is the regenerate run: its samples are the answered conversations
    (those whose regenerated answer is empty or blank are skipped as such, as any dataset's), and
    the tokens it supervises are the regenerated answers, not the original ones; an answer cut at
    --max-new-tokens (all of them here) is supervised through its last token, not the <|im_end|>
    the template closes it with (the target never generated it), a finished one through it."""
    report, extract = both_stages["report"]["extract"], both_stages["extract"]
    config = load_run(extract)
    assert config.dataset["kind"] == "regenerate_run" and config.dataset["run_id"] == both_stages["report"]["regenerate"]["run_id"]
    assert report["batches_done"] == report["batches_total"] >= 1
    convs = shard_conversations(both_stages["regen"])
    answered = [c for c in convs.values() if c.regenerated[-1].finish_reason != "prompt_too_long"]
    not_answered = len(convs) - len(answered)
    skipped = report["plan"]["skipped"]["counts"]
    assert skipped.get("not_regenerated", 0) == not_answered
    assert report["plan"]["samples"] + report["plan"]["skipped"]["total"] == len(convs)
    from hsx.plan import read_batch

    by_id = {c.id: c for c in answered}
    rows = {row.sample_index: row for w in read_windows(extract) for row in SampleRow.read_window(extract, w.name)}
    checked = earlier = cut = 0
    im_end = both_stages["tokenizer"].convert_tokens_to_ids("<|im_end|>")
    for batch in {row.batch for row in rows.values()}:
        plan = read_batch(extract, batch)
        for j, sample in enumerate(plan.sample_index_N.tolist()):
            row = rows[sample]
            if row.truncated:
                continue
            ids = plan.input_ids_T[plan.cu_seqlens_N1[j]:plan.cu_seqlens_N1[j + 1]]
            mask = plan.loss_mask_T[plan.cu_seqlens_N1[j]:plan.cu_seqlens_N1[j + 1]]
            tok = both_stages["tokenizer"]
            conv = by_id[str(row.record_id)]
            assert conv.messages[-1]["content"].strip() in tok.decode(ids.tolist())
            supervised = tok.decode(ids[mask == 1].tolist())
            assert conv.messages[-1]["content"].strip() in supervised
            for k, m in enumerate(conv.messages[:-1]):  # --turns last: the dataset's own earlier answers
                if m["role"] == "assistant" and len(m["content"].strip()) > 20:
                    assert m["content"].strip() not in supervised, (conv.id, k)
                    earlier += 1
            eot = int(np.flatnonzero(ids == im_end)[-1])  # --turns last: the answer is the render's last turn
            assert mask[eot - 1] == 1, conv.id
            assert mask[eot] == (conv.regenerated[-1].finish_reason != "length"), conv.id
            cut += conv.regenerated[-1].finish_reason == "length"
            checked += 1
    assert checked >= 10 and earlier >= 3 and cut >= 10, (checked, earlier, cut)


def test_drop_unfinished_skips_the_answers_cut_at_max_new_tokens(both_stages, tiny_cache):
    """--drop-unfinished on the regenerate run's address: every cut answer is skipped
    (``unfinished_answer``); here they all were, so no record is usable and nothing is planned."""
    from producer.planner import PlanOptions, prepare_plan
    from settings import Settings

    settings = Settings(_env_file=None, cache_dir=tiny_cache)
    opts = PlanOptions(dataset=both_stages["report"]["regenerate"]["address"], model="tiny-qwen3.5",
                       output=str(both_stages["tmp"] / "dropped"), max_length=384, batch_tokens=1536,
                       drop_unfinished=True)
    with pytest.raises(BadDataset, match="unfinished_answer"):
        prepare_plan(opts, settings).run()
    assert not (both_stages["tmp"] / "dropped").exists() or not any((both_stages["tmp"] / "dropped").iterdir())


def test_the_same_seed_gives_the_same_text(both_stages, shared_worker):
    """The same command into another store: the same run id and, sample by sample, the same answers."""
    tmp, env = both_stages["tmp"], both_stages["env"]
    again = cli_json(shared_worker.producer(["run", *JOB, "--output", str(tmp / "again"), "--json"], env))
    assert again["regenerate"]["run_id"] == both_stages["report"]["regenerate"]["run_id"]
    first, second = shard_conversations(both_stages["regen"]), shard_conversations(open_store(again["regenerate"]["address"]))
    assert first.keys() == second.keys()
    assert [c.messages for c in first.values()] == [second[i].messages for i in first]
    assert any(c.messages[-1]["content"] for c in first.values()), "the answers must hold text to compare"


class _Target:
    """What :func:`workers.generate.answer_batch` uses of a loaded target."""

    def __init__(self, model):
        self.model, self.group, self.gpu_lock = model, None, threading.Lock()
        self.pad_token_id = 151643


@pytest.fixture(scope="module")
def chat(tiny_cache):
    from producer.tokenising import shared_tokenizer
    from producer.masks import ChatTokeniser

    return ChatTokeniser(shared_tokenizer("tiny-qwen3.5", tiny_cache), max_length=384)


def _answers(tiny_qwen35, chat, convs, seed):
    from settings import Settings
    from workers.generate import answer_batch

    regen = RegenConfig(max_new_tokens=6, temperature=1.0, seed=seed)
    out, engine, _ = answer_batch(_Target(tiny_qwen35), chat, convs, regen, 384, Settings(_env_file=None), "b000000")
    assert engine == "generate"
    return {c.id: c.messages[-1]["content"] for c in out}


def test_the_same_command_on_a_finished_run_reports_what_was_answered(both_stages, shared_worker):
    """``run --regenerate`` again once both stages are done: nothing runs, and the regenerate run's report
    still says what the target answered (a new user saw the table lose its answered/unfinished rows)."""
    report = both_stages["report"]["regenerate"]
    again = cli_json(shared_worker.producer(["run", *JOB, "--output", str(both_stages["tmp"] / "out"), "--json"],
                                            both_stages["env"]))["regenerate"]
    assert again["batches_already_done"] == again["batches_total"] == report["batches_total"]
    assert again["answers"] == report["answers"]


def test_each_answer_depends_on_its_own_seed_not_on_its_batch(tiny_qwen35, chat):
    """An answer sampled alone equals the same answer sampled beside others (left padding, a generator
    per answer: a retried batch, or one planned otherwise, regenerates the same text); another seed
    gives another text."""
    from hsx.regen import PlannedConversation

    def conv(i, question):
        return PlannedConversation(sample_index=i, record_id=f"r{i}", messages=[
            {"role": "user", "content": question}, {"role": "assistant", "content": "original"}])

    convs = [conv(0, "hi"), conv(1, "tell me a long story about the sea and its ships"), conv(2, "why?")]
    together = _answers(tiny_qwen35, chat, convs, seed=1)
    alone = _answers(tiny_qwen35, chat, convs[1:2], seed=1)
    assert alone["r1"] == together["r1"] and together["r1"] != "original"
    assert _answers(tiny_qwen35, chat, convs[1:2], seed=2)["r1"] != together["r1"]
    assert sample_seed(1, "r1", 1) != sample_seed(1, "r1", 3) != sample_seed(2, "r1", 1)


def test_ctrl_c_then_the_same_command_resumes(tmp_path, tiny_cache, shared_worker):
    """Ctrl-C while the regenerate run's batches are answered: exit 130, the markers written are kept;
    the same command again answers only the batches left, then extracts."""
    job = [*JOB[:2], "8", *JOB[3:8], "384", *JOB[9:]]  # 8 records in batches of at most 392 tokens: several batches
    job[job.index("--regen-batch-tokens") + 1] = "392"  # --max-length 384 + --max-new-tokens 8
    out = tmp_path / "out"
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool",
                    faults="pause_marker=3", worker_concurrency=1, max_pending_uploads=1)  # two task threads
    # 3 s per batch: the Ctrl-C below lands while batches are left that no thread has started (at
    # 1 s, on a loaded machine, the two threads finished every batch before `run` took the signal)
    err = open(tmp_path / "stderr", "w+")
    proc = python_popen(["-m", "producer", "run", *job, "--output", str(out)], env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 180
        while not list(out.glob("*-regen-*/markers/*.json")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "stderr").read_text()[-3000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 130, (tmp_path / "stderr").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    run_dir = next(out.glob("*-regen-*"))
    regen_store = open_store(str(run_dir))
    kept = {b: m.shard.key for b, m in read_markers(regen_store).items()}
    planned = {b.batch for w in read_windows(regen_store) for b in w.batches}
    assert 1 <= len(kept) < len(planned), f"{len(kept)} of {len(planned)} batches done at the Ctrl-C"

    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state2", spool_dir=tmp_path / "spool")
    report = cli_json(shared_worker.producer(["run", *job, "--output", str(out), "--json"], env))
    regen = report["regenerate"]
    assert regen["run_id"] == run_dir.name and regen["batches_already_done"] == len(kept)
    assert regen["batches_done"] == regen["batches_total"] == len(planned)
    answered = [a for c in shard_conversations(regen_store).values() for a in c.regenerated]
    assert regen["answers"]["batches"] == len(planned) and regen["answers"]["engines"] == {"generate": len(planned)}
    assert regen["answers"]["completion_tokens"] == sum(a.completion_tokens for a in answered) > 0
    assert regen["answers"]["conversations"] == len(planned_samples(regen_store))
    assert regen["answers"]["unfinished"] == sum(not c.finished for c in shard_conversations(regen_store).values())
    assert {b: m.shard.key for b, m in read_markers(regen_store).items() if b in kept} == kept, "done batches not redone"
    assert done_batches(regen_store) == planned
    assert {i: c.id for i, c in shard_conversations(regen_store).items()} == planned_samples(regen_store)
    assert report["extract"]["batches_done"] == report["extract"]["batches_total"] >= 1


def test_continuous_batching_answers_an_attention_only_target_as_generate_does():
    """transformers' continuous batching (``generate_batch``, paged cache sized for the batch) serves a
    greedy run of an attention-only target (tiny Qwen3-8B shape) and gives batched ``generate``'s
    answers, prompt by prompt; sampling, or a Gated DeltaNet target, goes to ``generate``."""
    from settings import Settings
    from tinymodels import tiny_model
    from workers.generate import CONTINUOUS, GENERATE, generate_continuous, generate_left_padded, pick_engine

    model = tiny_model("qwen3").eval()
    greedy = RegenConfig(max_new_tokens=6)
    settings = Settings(_env_file=None)
    assert pick_engine(_Target(model), greedy, settings)[0] == CONTINUOUS
    assert pick_engine(_Target(model), RegenConfig(temperature=0.5), settings)[0] == GENERATE
    prompts = [[1, 5, 9, 30, 44], [7, 8], [10, 20, 30, 40, 50, 60, 7]]
    expected = generate_left_padded(model, prompts, [0, 0, 0], greedy, [2], 0)
    assert generate_continuous(model, prompts, greedy, [2], 0) == expected
    assert all(len(a) == 6 for a in expected)


def test_on_cuda_without_flash_attention_generate_answers_unless_forced(monkeypatch):
    """Continuous batching on CUDA without a flash-attention package runs sdpa without its decode fast
    path (0.37 of batched generate on the H200, BENCHMARKS.md): ``generate`` answers there, saying why;
    with flash attention, or forced by ``HSX_REGEN_ENGINE=continuous_batching``, continuous batching.
    (No CUDA here: the target says it is on CUDA; nothing runs on it.)"""
    import types

    import torch

    import workers.generate as generate
    from settings import Settings
    from tinymodels import tiny_model

    on_cuda = types.SimpleNamespace(model=tiny_model("qwen3").eval(), device=torch.device("cuda", 0))
    greedy, settings = RegenConfig(max_new_tokens=6), Settings(_env_file=None)
    monkeypatch.delenv("HSX_REGEN_ENGINE", raising=False)
    monkeypatch.setattr(generate, "flash_attention_installed", lambda: False)
    engine, why = generate.pick_engine(on_cuda, greedy, settings)
    assert engine == generate.GENERATE and "flash-attention" in why and "HSX_REGEN_ENGINE" in why
    monkeypatch.setenv("HSX_REGEN_ENGINE", "continuous_batching")
    assert generate.pick_engine(on_cuda, greedy, settings)[0] == generate.CONTINUOUS
    assert generate.pick_engine(on_cuda, RegenConfig(temperature=0.7), settings)[0] == generate.GENERATE  # cannot serve
    monkeypatch.delenv("HSX_REGEN_ENGINE")
    monkeypatch.setattr(generate, "flash_attention_installed", lambda: True)
    assert generate.pick_engine(on_cuda, greedy, settings)[0] == generate.CONTINUOUS


def test_a_gated_deltanet_target_is_answered_by_generate_saying_why(tiny_qwen35):
    """tiny-qwen3.5's linear_attention layers are not served by the paged cache: ``generate``, and the
    reason names the layer type."""
    from settings import Settings
    from workers.generate import GENERATE, pick_engine

    engine, why = pick_engine(_Target(tiny_qwen35), RegenConfig(), Settings(_env_file=None))
    assert engine == GENERATE and "linear_attention" in why


def test_turns_all_feeds_each_answer_into_the_next_prompt(tiny_qwen35, chat):
    """--turns all: one answer per assistant turn, in order; the second prompt holds the first answer
    (its prompt is longer than the original first reply would make it), and a --stop string cuts an
    answer before it (finish reason stop_string)."""
    from hsx.regen import PlannedConversation
    from settings import Settings
    from workers.generate import answer_batch, prompt_ids

    long_reply = "an original reply that is much longer than six generated tokens could ever be " * 3
    conv = PlannedConversation(sample_index=0, record_id="multi", messages=[
        {"role": "user", "content": "first question"}, {"role": "assistant", "content": long_reply},
        {"role": "user", "content": "second question"}, {"role": "assistant", "content": long_reply}])
    regen = RegenConfig(max_new_tokens=6, turns="all")
    (out,), _engine, timing = answer_batch(_Target(tiny_qwen35), chat, [conv], regen, 384, Settings(_env_file=None), "b0")
    assert timing["rounds"] == 2 and [a.turn for a in out.regenerated] == [1]  # the first answer was cut: it stops there
    assert out.messages[1]["content"] != long_reply and len(out.messages) == 2 and not out.finished

    # a stop string the first answer holds (one of its characters): it ends there, and the second turn is answered
    first = out.messages[1]["content"]
    stop = next(ch for ch in first if not ch.isspace())
    regen = RegenConfig(max_new_tokens=6, turns="all", stop=(stop,))
    (out,), _engine, _ = answer_batch(_Target(tiny_qwen35), chat, [conv], regen, 384, Settings(_env_file=None), "b0")
    assert [a.turn for a in out.regenerated] == [1, 3] and out.regenerated[0].finish_reason == "stop_string"
    assert out.messages[1]["content"] == first[:first.index(stop)] and len(out.messages) == 4
    assert out.messages[3]["content"] != long_reply
    second_prompt = out.regenerated[1].prompt_tokens
    assert second_prompt == len(prompt_ids(chat, "multi", out.messages[:3], None))
    assert second_prompt < len(prompt_ids(chat, "multi", conv.messages[:3], None)), "the first answer, not the original"


def test_verify_names_an_altered_shard_and_repair_redoes_only_that_batch(both_stages, tmp_path):
    """A copy of the regenerate run with one shard's bytes changed: verify reports that batch only
    (``shard_altered``), and ``reconcile --repair``'s step removes its marker and shard, no other."""
    import shutil

    from producer.reconcile import repair_bad_batches
    from producer.regenerate import verify_regenerated

    source = Path(both_stages["regen"].local_path("run.json")).parent
    copy = tmp_path / source.name
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("workers"))
    store = open_store(str(copy))
    assert verify_regenerated(store)["ok"]
    markers = read_markers(store)
    victim = sorted(markers)[0]
    path = copy / markers[victim].shard.key
    path.write_bytes(path.read_bytes().replace(b'"finished": false', b'"finished": true ', 1))
    report = verify_regenerated(store)
    assert [(p["batch"], p["kind"]) for p in report["problems"]] == [(victim, "shard_altered")]
    assert repair_bad_batches(store) == {victim: ["shard_altered"]}
    assert done_batches(store) == set(markers) - {victim} and not path.exists()


# ------------------------------------------------------------------------------------------------
# The identity of a regenerate run (in process: no run is planned)


def _regen_config(**changes):
    """The run.json of tests/data/legacy-runs as a run of this code's identity version, with ``changes``."""
    import dataclasses

    from hsx.runconfig import IDENTITY_VERSION, RunConfig

    base = RunConfig.from_json((ROOT / "tests" / "data" / "legacy-runs" / "run-v3-a4fd82d.json").read_bytes())
    return dataclasses.replace(base, identity_version=IDENTITY_VERSION, **changes)


def test_a_regenerate_run_id_ignores_the_extraction_only_options():
    """--layers/--preset/--dflash-layers/--draft-config/--final (``layers``) and --store-dtype decide only
    hidden-state bytes: the same regenerate run whatever they are; an extraction run still hashes them."""
    import dataclasses

    from hsx.runconfig import LayersConfig

    regen = RegenConfig(temperature=0.8, seed=3).model_dump(mode="json")
    a = _regen_config(regenerate=regen)
    other_layers = LayersConfig.model_validate({**a.layers.as_dict(), "layer_ids": [0], "final": "none"})
    b = dataclasses.replace(a, layers=other_layers, store_dtype="fp8" if a.store_dtype != "fp8" else "float32")
    assert a.identity_sha256() == b.identity_sha256() and a.default_run_id("d-regen") == b.default_run_id("d-regen")
    assert "layers" not in a.identity() and "store_dtype" not in a.identity()
    extract_a, extract_b = dataclasses.replace(a, regenerate=None), dataclasses.replace(b, regenerate=None)
    assert extract_a.identity_sha256() != extract_b.identity_sha256()
    assert {"layers", "store_dtype"} <= set(extract_a.identity())
    # what else a regenerate run uses still counts
    assert dataclasses.replace(a, max_length=a.max_length + 1).identity_sha256() != a.identity_sha256()


def test_greedy_decoding_ignores_seed_top_k_and_top_p_in_the_run_id():
    greedy = [_regen_config(regenerate=RegenConfig(**o).model_dump(mode="json")).identity_sha256()
              for o in ({}, {"seed": 5}, {"top_k": 40}, {"top_p": 0.5}, {"seed": 9, "top_k": 3, "top_p": 0.9})]
    assert len(set(greedy)) == 1
    sampled = [_regen_config(regenerate=RegenConfig(temperature=0.7, **o).model_dump(mode="json")).identity_sha256()
               for o in ({}, {"seed": 5}, {"top_k": 40}, {"top_p": 0.5})]
    assert len(set(sampled)) == 4 and greedy[0] not in sampled
    other = _regen_config(regenerate=RegenConfig(max_new_tokens=9).model_dump(mode="json")).identity_sha256()
    assert other != greedy[0]


@pytest.mark.parametrize("option,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-inf"),
                                          ("--top-p", "nan"), ("--top-p", "inf")])
def test_nan_and_inf_generation_options_are_refused(option, value, capsys, tmp_path):
    from producer.cli import main

    code = main(["regenerate", str(tmp_path / "none.jsonl"), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                 f"{option}={value}"])
    out = capsys.readouterr()
    assert code == 2 and f"{option} " in out.out + out.err and "finite" in out.out + out.err
    with pytest.raises(Exception, match="finite"):
        RegenConfig(**{option[2:].replace("-", "_"): float(value)}).check()


@pytest.mark.parametrize("command", ["run", "enqueue"])
@pytest.mark.parametrize("option", [["--max-new-tokens", "8"], ["--temperature", "0.5"], ["--top-p", "0.9"],
                                    ["--top-k", "5"], ["--stop", "x"], ["--turns", "all"], ["--regen-batch-tokens", "9000"]])
def test_generation_options_without_regenerate_are_refused(command, option, capsys, tmp_path):
    """Without --regenerate nothing is generated: run/enqueue refuse a generation option (exit 2) naming it
    and the fix, before anything is read or planned; --seed (also --shuffle's and --sample's) is not one."""
    from producer.cli import main

    code = main([command, str(tmp_path / "none.jsonl"), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"), *option])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert code == 2 and f"error: {option[0]} is a generation option" in text
    assert ("--regenerate" if command == "run" else "regenerate DATASET --enqueue") in text
    assert not (tmp_path / "out").exists()


def test_seed_is_not_a_generation_option_and_its_help_says_it_seeds_the_sampling(capsys):
    from argparse import Namespace

    from producer.cli import main
    from producer.regenerate import generation_options, given_generation_options

    args = Namespace(seed=4, max_new_tokens=None, temperature=None, top_p=None, top_k=None, stop=None, turns=None)
    assert given_generation_options(args) == []
    assert generation_options(args) == RegenConfig(seed=4).model_dump(mode="json")
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "of a regenerate run's sampling (default 0 there)" in " ".join(capsys.readouterr().out.split())


def _fake_regenerate_run(tmp_path) -> Path:
    """A directory holding a regenerate run's run.json (nothing else is read before the refusal)."""
    run = tmp_path / "d-regen-000000000000"
    run.mkdir()
    (run / "run.json").write_bytes(_regen_config(regenerate=RegenConfig().model_dump(mode="json"),
                                                 run_id=run.name).to_json())
    return run


@pytest.mark.parametrize("command", [["export", "{out}", "--format", "speculators"], ["vocab-counts"]])
def test_export_and_vocab_counts_refuse_a_regenerate_run(command, tmp_path, capsys):
    from producer.cli import main

    run = _fake_regenerate_run(tmp_path)
    code = main([command[0], str(run), *[c.format(out=tmp_path / "exported") for c in command[1:]]])
    captured = capsys.readouterr()
    text = "".join((captured.out + captured.err).split())  # the console wraps long lines
    assert code == 2, text
    assert "".join((f"error: {run} is a regenerate run (regenerated conversations, no hidden states): extract it first "
                    f"with `python -m producer run {run} --model ...`").split()) in text
    assert not (tmp_path / "exported").exists() and not (run / "vocab_counts.safetensors").exists()
    # once it has been extracted beside it (as `run --regenerate` does it), the refusal names that run
    extraction = tmp_path / f"{run.name}-0123456789ab"
    extraction.mkdir()
    (extraction / "run.json").write_text(json.dumps({"dataset": {"kind": "regenerate_run", "run_id": run.name}}))
    (tmp_path / f"{run.name}-other").mkdir()
    (tmp_path / f"{run.name}-other" / "run.json").write_text(json.dumps({"dataset": {"kind": "files"}}))
    code = main([command[0], str(run), *[c.format(out=tmp_path / "exported") for c in command[1:]]])
    text = "".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
    assert code == 2 and f"itsextractionis{extraction}:givethataddressinstead" in text, text


def test_the_readers_refuse_a_regenerate_run(tmp_path):
    from hsx.errors import BadConfig
    from hsx.reader import HiddenStatesDataset, IterableHiddenStatesDataset

    run = _fake_regenerate_run(tmp_path)
    for reader in (HiddenStatesDataset, IterableHiddenStatesDataset):
        with pytest.raises(BadConfig, match=r"is a regenerate run \(regenerated conversations, no hidden states\): "
                                            r"extract it first with `python -m producer run .* --model \.\.\.`"):
            reader(str(run))


def test_verify_recompute_says_it_does_not_apply_to_a_regenerate_run(both_stages, capsys):
    from producer.cli import main

    address = both_stages["report"]["regenerate"]["address"]
    code = main(["verify", address, "--recompute", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "--recompute does not apply to a regenerate run" in " ".join(captured.err.split())
    assert json.loads(captured.out)["ok"] and "recompute" not in json.loads(captured.out)


def test_the_readme_says_which_turns_are_the_targets_and_that_max_length_may_cut_an_answer():
    text = (ROOT / "README.md").read_text()
    section = " ".join(text[text.index("## Regenerating the responses"):].split("\n## ", 1)[0].split())
    assert "the earlier assistant turns keep the dataset's original answers. The extraction supervises only the target's answers" in section
    assert "the earlier turns are context, with loss mask 0" in section
    assert ("An answer cut at `--max-new-tokens` or before a `--stop` string (given as `hsx_unfinished_turns`) is supervised "
            "through its last generated token only") in section
    assert "`--turns all` answers every assistant turn in order" in section
    assert "the chained extraction applies its own `--max-length`" in section and "truncated" in section
    assert "are not part of a regenerate run's identity" in section


@pytest.mark.parametrize("command", [["regenerate"], ["run", "--regenerate"]])
def test_a_regenerate_run_on_workers_of_several_gpus_is_refused_before_anything_starts(command, capsys, tmp_path):
    """A worker of a tensor-parallel group parks regenerate batches for a one-GPU worker: a command
    that would start only such workers is refused (exit 2) with the two-step fix, nothing started."""
    from producer.cli import main

    code = main([command[0], str(tmp_path / "none.jsonl"), *command[1:], "--model", "tiny-qwen3.5", "--output",
                 str(tmp_path / "out"), "--gpus-per-worker", "2"])
    text = " ".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
    assert code == 2 and "error: --gpus-per-worker 2 (HSX_GPUS_PER_WORKER)" in text, text
    assert "Regenerate with --gpus-per-worker 1, then extract" in text and "Nothing was started" in text
    assert not (tmp_path / "out").exists()


def _shallow_checkpoint(tiny_cache, dest: Path, num_layers: int) -> Path:
    """tiny-qwen3.5's checkpoint with a config of ``num_layers`` decoder layers (planning reads the
    config and hashes the files, it loads no weights)."""
    import shutil

    from hsx.models import resolve_model_path

    shutil.copytree(resolve_model_path("tiny-qwen3.5", tiny_cache), dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(num_hidden_layers=num_layers, layer_types=config["layer_types"][:num_layers])
    (dest / "config.json").write_text(json.dumps(config))
    return dest


@pytest.mark.parametrize("num_layers,refusal", [(6, r"gives ids \[1, 2, 2\], which repeat"), (2, "out of range")])
def test_a_regenerate_run_does_not_refuse_a_model_too_shallow_for_the_layer_preset(num_layers, refusal, tiny_cache,
                                                                                 tmp_path):
    """A regenerate run captures no hidden states: the eagle3 preset that a 6- or 2-layer model cannot
    take refuses its extraction, not its regenerate run (whose run.json records no layers)."""
    from hsx.errors import BadConfig
    from producer.planner import PlanOptions, prepare_plan
    from settings import Settings

    model = str(_shallow_checkpoint(tiny_cache, tmp_path / f"shallow-{num_layers}", num_layers))
    settings = Settings(_env_file=None, cache_dir=tiny_cache)
    opts = PlanOptions(dataset="sharegpt", model=model, output=str(tmp_path / "out"), max_length=384, limit=3)
    with pytest.raises(BadConfig, match=refusal):
        prepare_plan(opts, settings)
    import dataclasses

    job = prepare_plan(dataclasses.replace(opts, regenerate=RegenConfig(max_new_tokens=8).model_dump(mode="json")),
                       settings)
    assert job.config.model.num_layers == num_layers and list(job.config.layers.layer_ids) == []
    assert job.config.layers.final.value == "none"


def test_run_regenerate_checks_the_extraction_layers_before_the_regenerate_stage(tiny_cache, tmp_path, monkeypatch):
    """``run --regenerate`` on a model the extraction's layers do not fit: refused before its regenerate
    stage starts (no broker, worker or GPU work), not after every answer was generated."""
    import producer.run as run_module
    from hsx.errors import BadConfig
    from producer.planner import PlanOptions
    from settings import Settings

    started = []
    monkeypatch.setattr(run_module, "run_job", lambda *a, **k: started.append(a) or (1, {}))  # a first stage that failed
    model = str(_shallow_checkpoint(tiny_cache, tmp_path / "shallow", 6))
    opts = PlanOptions(dataset="sharegpt", model=model, output=str(tmp_path / "out"), max_length=384, limit=3)
    with pytest.raises(BadConfig, match="which repeat"):
        run_module.run_regenerated(opts, RegenConfig().model_dump(mode="json"), Settings(_env_file=None, cache_dir=tiny_cache),
                                   console=None)
    assert started == [] and not (tmp_path / "out").exists()
    # layers the model takes pass the check, and the stages run
    import dataclasses

    run_module.run_regenerated(dataclasses.replace(opts, layers="1,3"), RegenConfig().model_dump(mode="json"),
                               Settings(_env_file=None, cache_dir=tiny_cache), console=None)
    assert len(started) == 1



def _regen_plan(tiny_cache, output, dataset="sharegpt", *, max_new_tokens=512, **options):
    """A regenerate run planned (no worker) into ``output``: ``(config, [(rows' costs, rows' prompts)])`` per
    batch in plan order, each row's cost as the plan counts it and its prompt's length as the worker renders it."""
    from hsx.plan import read_batch
    from hsx.regen import PlannedConversation, regen_plan_key
    from producer.planner import PlanOptions, prepare_plan, prompt_tokens
    from settings import Settings
    from workers.generate import prompt_ids

    opts = PlanOptions(dataset=dataset, model="tiny-qwen3.5", output=str(output),
                       regenerate=RegenConfig(max_new_tokens=max_new_tokens).model_dump(mode="json"), **options)
    job = prepare_plan(opts, Settings(_env_file=None, cache_dir=tiny_cache))
    planned = job.run()
    batches = []
    for summary in planned.batches:
        plan = read_batch(planned.run_store, summary.batch)
        convs = parse_lines(planned.run_store.read(regen_plan_key(summary.batch)), PlannedConversation, "plan")
        prompts = []
        for c in convs:  # --turns last: the last assistant turn whose prompt fits (workers/generate.py answer_batch)
            for t in reversed([i for i, m in enumerate(c.messages) if m["role"] == "assistant"]):
                n = len(prompt_ids(job.chat, c.record_id, c.messages[:t], c.tools))
                if n < planned.config.max_length:
                    break
            prompts.append(n)
        masks = np.split(plan.loss_mask_T, plan.cu_seqlens_N1[1:-1])
        batches.append(([prompt_tokens(m) + max_new_tokens for m in masks], prompts))
    return planned.config, batches


def _cut_as_decoding_batches(batches, budget: int, rows_cap: int) -> None:
    """Each batch (longest cost first, as the planner cuts one window) holds as many rows as fit
    ``rows x its longest cost <= budget``, at most ``rows_cap``, the last one what is left."""
    left = sum(len(costs) for costs, _p in batches)
    for costs, _prompts in batches:
        assert len(costs) == min(rows_cap, budget // max(costs), left), (len(costs), max(costs))
        left -= len(costs)


def test_regenerate_batches_are_sized_for_decoding_not_for_extraction(tiny_cache, tmp_path):
    """At --max-length 4096 a regenerate batch is one generate call's worth of answers: rows x (longest
    prompt + max_new_tokens) within HSX_REGEN_BATCH_TOKENS (262,144), at most HSX_MAX_BATCH_SAMPLES (256)
    rows (extraction's 32,768 tokens, rows x longest conversation, held a few dozen); each row's prompt
    is the one the worker renders (to within the 4 tokens a template renders differently before a
    generation prompt)."""
    config, batches = _regen_plan(tiny_cache, tmp_path / "out", max_length=4096, limit=1000)
    assert (config.batch_tokens, config.max_batch_samples) == (262144, 256)
    _cut_as_decoding_batches(batches, 262144, 256)
    for costs, prompts in batches:
        assert all(0 <= p - (c - 512) <= 4 for c, p in zip(costs, prompts)), "a row costs its prompt + max_new_tokens"
    # even the longest prompts (up to 4,095 tokens) go 56 to a batch, where extraction's budget held 8 of them
    assert min(len(costs) for costs, _p in batches) >= 262144 // (4095 + 512) and len(batches) < 12


def test_a_regenerate_row_costs_its_prompt_and_max_new_tokens_not_its_whole_conversation(tiny_cache, tmp_path):
    """Short questions with long original answers: the answers are regenerated, so their tokens cost
    nothing in the plan; a batch holds budget // (longest prompt + max_new_tokens) rows, where the whole
    conversations (about 1,200 tokens) would fit 3."""
    data = tmp_path / "long-answers.jsonl"
    words = " ".join(f"word{i}" for i in range(600))
    data.write_text("".join(json.dumps({"id": f"r{i}", "messages": [{"role": "user", "content": f"question {i}?"},
                                                                   {"role": "assistant", "content": words}]}) + "\n"
                            for i in range(40)))
    config, batches = _regen_plan(tiny_cache, tmp_path / "out", str(data), max_new_tokens=64, max_length=2048,
                                  regen_batch_tokens=4224)
    assert config.batch_tokens == 4224
    _cut_as_decoding_batches(batches, 4224, 256)
    for costs, prompts in batches:
        assert costs == [p + 64 for p in prompts]
    assert len(batches) <= 2 and max(len(costs) for costs, _p in batches) >= 20


def test_a_regenerate_plan_is_the_same_for_the_same_options_and_its_id_names_what_sizes_it(tiny_cache, tmp_path):
    """Same dataset and options: the same run id and the same batches (so a resume finds its plan);
    another --max-new-tokens or --regen-batch-tokens: other batches and another run id."""
    def plan(name, max_new_tokens=256, regen_batch_tokens=8192):
        config, batches = _regen_plan(tiny_cache, tmp_path / name, max_length=1024, limit=120,
                                      max_new_tokens=max_new_tokens, regen_batch_tokens=regen_batch_tokens)
        return config.run_id, [costs for costs, _p in batches]

    first = plan("a")
    assert plan("b") == first
    longer = plan("c", max_new_tokens=512)
    assert longer[0] != first[0] and [len(c) for c in longer[1]] != [len(c) for c in first[1]]
    bigger = plan("d", regen_batch_tokens=16384)
    assert bigger[0] != first[0] and len(bigger[1]) < len(first[1])


def test_a_regenerate_budget_below_one_prompt_and_its_answer_is_refused(tiny_cache, tmp_path):
    from hsx.errors import BadConfig

    with pytest.raises(BadConfig, match=r"--regen-batch-tokens 4000 is smaller than --max-length 4096 \+ --max-new-tokens 512"):
        _regen_plan(tiny_cache, tmp_path / "out", limit=2, regen_batch_tokens=4000)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_producer_regenerate_refuses_batch_tokens_for_regen_batch_tokens(capsys, tmp_path):
    """``regenerate --batch-tokens`` would size nothing (it is the extraction's budget): refused, naming the option that does."""
    from producer.cli import main

    code = main(["regenerate", str(tmp_path / "none.jsonl"), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                 "--batch-tokens", "65536"])
    text = " ".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
    assert code == 2 and "--batch-tokens 65536 sizes extraction batches" in text and "--regen-batch-tokens" in text
    assert not (tmp_path / "out").exists()



def test_producer_regenerate_hides_and_refuses_what_only_an_extraction_stores(capsys, tmp_path):
    """``regenerate --layers/--preset/--final/--store-dtype...`` would change nothing (a regenerate run stores answers,
    not hidden states): not in its help, and refused naming the extraction command that takes them as given."""
    from producer.cli import main

    with pytest.raises(SystemExit):
        main(["regenerate", "--help"])
    usage = capsys.readouterr().out
    assert "--max-new-tokens" in usage and not any(o in usage for o in ("--layers", "--preset", "--final", "--store-dtype",
                                                                       "--draft-config", "--dflash-layers"))
    code = main(["regenerate", str(tmp_path / "none.jsonl"), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                 "--preset", "dflash", "--store-dtype", "fp8"])
    text = " ".join((lambda c: c.out + c.err)(capsys.readouterr()).split())
    assert code == 2 and text.startswith("error: --preset, --store-dtype: a regenerate run stores the target's answers"), text
    assert "`producer run <its address> --model ... --preset dflash --store-dtype fp8`" in text and "Nothing was started" in text
    assert not (tmp_path / "out").exists()
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    run_usage = capsys.readouterr().out
    assert all(o in run_usage for o in ("--layers", "--preset", "--store-dtype")), "run keeps them"

class _Bar:
    """The progress ``wait_for_markers`` draws on; each update certifies one more batch, 10 s later."""

    def __init__(self, store, batches):
        self.store, self.pending, self.t, self.tasks, self.updates = store, list(batches), 0.0, [], []

    def add_task(self, description, **fields):
        self.tasks.append(description)
        return 0

    def update(self, task, **fields):
        self.updates.append(fields)
        if self.pending:
            from hsx.layout import marker_key

            self.t += 10.0
            self.store.write(marker_key(self.pending.pop(0).batch), b"{}")


@pytest.mark.timeout(120)
def test_a_regenerate_runs_progress_says_regenerating_and_counts_generated_answers(tiny_cache, tmp_path):
    """``run``'s bar for a regenerate run is ``regenerating``, with the answers generated and their rate
    (a regenerate batch's planned tokens are its conversations', not what was generated), never
    "extracting ... tok/s"; an extraction run's keeps its name and tokens/s."""
    from producer.cli import progress_factory
    from producer.planner import PlanOptions, prepare_plan
    from producer.run import _Launch, progress_label, wait_for_markers
    from settings import Settings

    settings = Settings(_env_file=None, cache_dir=tiny_cache)
    opts = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp_path / "out"), max_length=384, limit=12,
                       regenerate=RegenConfig(max_new_tokens=8).model_dump(mode="json"), regen_batch_tokens=392)
    job = prepare_plan(opts, settings)
    planned = job.run()
    assert len(planned.batches) >= 4
    from hsx.layout import marker_key

    planned.run_store.write(marker_key(planned.batches[0].batch), b"{}")  # done before: counted, not in the rate
    bar = _Bar(planned.run_store, planned.batches[1:])
    waited = wait_for_markers(planned, None, progress=bar, poll_s=0.01, clock=lambda: bar.t)
    assert waited["done"] == len(planned.batches) and bar.tasks == ["regenerating"]
    assert all("tok_s" not in u and "samples" not in u for u in bar.updates), bar.updates
    assert bar.updates[-1]["answers"] == sum(b.num_samples for b in planned.batches)
    rate = bar.updates[-1]["answers_s"]
    later = planned.batches[1:]  # the first new marker opens the window (producer/status.py recent_rate)
    assert rate == pytest.approx(sum(b.num_samples for b in later[1:]) / (10.0 * (len(later) - 1)))

    launch = _Launch(settings, opts, None, None, None, bar)  # the bar shown while the plan is written
    launch.sender = object()
    launch.tick(job)
    assert bar.tasks[-1] == "regenerating"
    import dataclasses

    assert progress_label(dataclasses.replace(planned.config, regenerate=None)) == "extracting"

    progress = progress_factory()
    task = progress.add_task("regenerating", total=3)
    progress.update(task, completed=1, answers=5, answers_s=float("nan"))
    assert progress.tasks[0].fields["info"] == "5 answers generated  measuring answers/s"
    progress.update(task, completed=2, answers=9, answers_s=2.5)
    assert progress.tasks[0].fields["info"] == "9 answers generated  2.5 answers/s now"


def test_a_worker_keeps_one_continuous_batching_manager_per_run_and_the_answers_stay_the_same(monkeypatch):
    """With the run's sizing (``capacity``) transformers' manager and paged cache are built once and kept
    for the run's next batches: each batch gets batched ``generate``'s answers, a batch answered again
    after another gets the same ones; another run's end ids build another manager; a failure, and an
    extraction batch's forward on the same worker, drop it."""
    import types

    from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

    import workers.extract as extract
    from tinymodels import tiny_model
    from workers.generate import KEPT_MANAGER, generate_continuous, generate_left_padded, release_continuous_batching

    model = tiny_model("qwen3").eval()
    greedy = RegenConfig(max_new_tokens=6)
    capacity = (512, 4, 64)  # the run's batch_tokens, max_batch_samples, max_length
    a = [[1, 5, 9, 30, 44], [7, 8], [10, 20, 30, 40, 50, 60, 7]]
    b = [[3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [99, 98]]
    expected = {name: generate_left_padded(model, p, [0] * len(p), greedy, [2], 0) for name, p in (("a", a), ("b", b))}

    assert generate_continuous(model, a, greedy, [2], 0, capacity) == expected["a"]
    kept = model._cached_continuous_batching_manager
    assert generate_continuous(model, b, greedy, [2], 0, capacity) == expected["b"]
    assert generate_continuous(model, a, greedy, [2], 0, capacity) == expected["a"]
    assert model._cached_continuous_batching_manager is kept, "one manager for the run's batches"
    assert generate_continuous(model, a, greedy, [2], 0) == expected["a"]  # the per-batch manager agrees

    other = generate_continuous(model, a, greedy, [2, 7], 0, capacity)  # another run: other end ids
    assert model._cached_continuous_batching_manager is not kept
    assert other == generate_left_padded(model, a, [0] * 3, greedy, [2, 7], 0)

    def fails(**kwargs):
        return {}

    monkeypatch.setattr(model, "generate_batch", fails)
    with pytest.raises(RuntimeError, match="returned 0 answers"):
        generate_continuous(model, a, greedy, [2], 0, capacity)
    assert not hasattr(model, "_cached_continuous_batching_manager") and KEPT_MANAGER not in model.__dict__

    def fails_each_request(inputs, **kwargs):  # as transformers delivers a request whose batch raised (fail_and_deliver)
        return {f"req_{i}": GenerationOutput(request_id=f"req_{i}", prompt_ids=p, status=RequestStatus.FAILED,
                                             error="cannot reach the hub for kernels-community/flash-attn2")
                for i, p in enumerate(inputs)}

    monkeypatch.setattr(model, "generate_batch", fails_each_request)
    with pytest.raises(RuntimeError, match="failed 3 of 3 requests .*FAILED.*flash-attn2"):
        generate_continuous(model, a, greedy, [2], 0, capacity)  # never three empty answers
    monkeypatch.undo()

    generate_continuous(model, b, greedy, [2], 0, capacity)
    assert KEPT_MANAGER in model.__dict__
    for name in ("_room_before_forward", "_check_cancelled_now", "_take_host_buffer"):
        monkeypatch.setattr(extract, name, lambda *args: None)
    monkeypatch.setattr(extract, "_launch", lambda work, job: [types.SimpleNamespace(wait=lambda: "states")])
    work = types.SimpleNamespace(target=types.SimpleNamespace(model=model, gpu_lock=threading.Lock()), expected_bytes=0,
                                 ranges=[(0, 1)])
    assert extract.forward(work, types.SimpleNamespace(phase=lambda name: None)).captured == "states"
    assert not hasattr(model, "_cached_continuous_batching_manager") and KEPT_MANAGER not in model.__dict__
    release_continuous_batching(model)  # nothing kept: a no-op


def test_an_answer_without_an_end_id_shorter_than_max_new_tokens_is_refused_not_recorded_as_finished(chat):
    """An answer ends with an end-of-turn id (``stop``) or at ``--max-new-tokens`` (``length``): anything
    shorter is an engine's lost output (a failed request's empty token list), never a finished answer."""
    from workers.generate import finish

    regen = RegenConfig(max_new_tokens=4)
    end = sorted(chat.end_of_turn_ids)[0]
    assert finish(chat.tokenizer, [9707, end], [end], regen)[1:] == ("stop", 2)
    assert finish(chat.tokenizer, [9707, 9707, 9707, 9707], [end], regen)[1:] == ("length", 4)
    for cut in ([], [9707, 9707]):
        with pytest.raises(RuntimeError, match=f"{len(cut)} tokens ends without an end-of-turn id"):
            finish(chat.tokenizer, cut, [end], regen)


def test_a_shard_line_with_an_empty_stop_answer_is_unreadable_naming_the_failed_request():
    """A ``stop`` or ``length`` answer of 0 tokens (what workers before 2026-12-03 wrote for a request
    continuous batching had failed) does not read as an answer: verify then reports its batch
    ``shard_unreadable``, which ``reconcile --repair`` redoes; a 0-token ``stop_string`` answer is one."""
    def line(reason: str, tokens: int) -> bytes:
        return json.dumps({"id": "r1", "sample_index": 0, "messages": [{"role": "user", "content": "hi"}], "finished": True,
                           "regenerated": [{"turn": 1, "finish_reason": reason, "prompt_tokens": 9,
                                            "completion_tokens": tokens}]}).encode()

    assert parse_lines(line("stop", 3), RegeneratedConversation, "s")[0].regenerated[0].completion_tokens == 3
    assert parse_lines(line("stop_string", 0), RegeneratedConversation, "s")[0].regenerated[0].finish_reason == "stop_string"
    for reason in ("stop", "length"):
        with pytest.raises(BadPlan, match=f"(?s)line 1 .*'{reason}' answer of 0 tokens is an engine's failed request"):
            parse_lines(line(reason, 0), RegeneratedConversation, "shards/b.jsonl")


def test_a_run_whose_only_batch_is_done_shows_no_rate_rather_than_measuring(tiny_cache, tmp_path):
    """One marker gives no rate: while batches are left the bar says "measuring"; when the last one
    is done (here the only one) it shows the samples and no rate, not a "measuring" that never ends."""
    from hsx.layout import marker_key
    from producer.planner import PlanOptions, prepare_plan
    from producer.run import wait_for_markers
    from settings import Settings

    settings = Settings(_env_file=None, cache_dir=tiny_cache)
    opts = PlanOptions(dataset="sharegpt", model="tiny-qwen3.5", output=str(tmp_path / "out"), max_length=384, limit=3)
    planned = prepare_plan(opts, settings).run()
    assert len(planned.batches) == 1
    planned.run_store.write(marker_key(planned.batches[0].batch), b"{}")
    bar = _Bar(planned.run_store, [])
    waited = wait_for_markers(planned, None, progress=bar, poll_s=0.01, clock=lambda: bar.t)
    assert waited["done"] == 1 and bar.tasks == ["extracting"]
    assert bar.updates[-1]["samples"] == planned.batches[0].num_samples and bar.updates[-1]["tok_s"] is None


def test_an_answer_cut_before_a_stop_string_is_supervised_without_the_end_of_turn_token_as_one_cut_at_the_limit():
    """The extraction's record of a regenerated conversation (``producer.regenerate.extraction_record``): every
    answered turn in ``hsx_supervised_turns``; the turns whose end-of-turn token the target did not generate (cut
    at --max-new-tokens, ``length``, or before a --stop string, ``stop_string``: the target went on with the
    string) in ``hsx_unfinished_turns``; a turn that stopped by itself is not. --drop-unfinished skips only a
    conversation with an answer cut at the limit (``finished`` is false); nothing answered is ``not_regenerated``."""
    from hsx.errors import BadRecord
    from hsx.regen import Answer
    from producer.regenerate import extraction_record

    turns = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
             {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"},
             {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]

    def conv(*reasons: str) -> RegeneratedConversation:
        answers = [Answer(turn=t, finish_reason=r, prompt_tokens=10, completion_tokens=3) for t, r in zip((1, 3, 5), reasons)]
        return RegeneratedConversation(id="c", sample_index=4, messages=turns, regenerated=answers,
                                       finished=all(r in ("stop", "stop_string") for r in reasons))

    record = extraction_record(conv("stop_string", "stop", "length"), "run", drop_unfinished=False).raw
    assert record["hsx_supervised_turns"] == [1, 3, 5] and record["hsx_unfinished_turns"] == [1, 5], record
    assert "hsx_unfinished_turns" not in extraction_record(conv("stop", "stop"), "run", False).raw
    assert extraction_record(conv("stop_string"), "run", True).raw["hsx_unfinished_turns"] == [1]
    dropped = extraction_record(conv("stop", "length"), "run", True).raw
    assert isinstance(dropped, BadRecord) and dropped.reason == "unfinished_answer", dropped
    nothing = extraction_record(conv("prompt_too_long"), "run", False).raw
    assert isinstance(nothing, BadRecord) and nothing.reason == "not_regenerated", nothing


def test_answers_cut_by_a_stop_string_are_counted_and_extracted_without_their_end_of_turn_token(tmp_path, tiny_cache,
                                                                                                shared_worker):
    """``producer run DATASET --regenerate --stop e``: the regenerate run's markers count the conversations cut before the
    stop string (``stop_cut``, said in the summary as ``cut by --stop``), and the extraction supervises each such answer
    through its last token, with loss mask 0 on the <|im_end|> the template closes it with."""
    from producer.tokenising import shared_tokenizer
    from hsx.plan import read_batch

    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool")
    job = [*JOB, "--stop", "e"]
    job[job.index("--limit") + 1] = "12"
    job[job.index("--max-new-tokens") + 1] = "16"
    report = cli_json(shared_worker.producer(["run", *job, "--output", str(tmp_path / "out"), "--json"], env))
    regen_store, extract = open_store(report["regenerate"]["address"]), open_store(report["extract"]["address"])
    convs = shard_conversations(regen_store)
    stopped = {c.id for c in convs.values() if c.regenerated and c.regenerated[-1].finish_reason == "stop_string"}
    assert report["regenerate"]["answers"]["stop_cut"] == len(stopped) >= 3, report["regenerate"]["answers"]
    table = " ".join(shared_worker.producer(["run", *job, "--output", str(tmp_path / "out")], env).stdout.split())
    assert f"cut by --stop │ {len(stopped)} conversations with an answer cut before a --stop string" in table, table

    tok = shared_tokenizer("tiny-qwen3.5", tiny_cache)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    rows = {row.sample_index: row for w in read_windows(extract) for row in SampleRow.read_window(extract, w.name)}
    checked = 0
    for batch in {row.batch for row in rows.values()}:
        plan = read_batch(extract, batch)
        for j, sample in enumerate(plan.sample_index_N.tolist()):
            row = rows[sample]
            if row.truncated or str(row.record_id) not in stopped:
                continue
            ids = plan.input_ids_T[plan.cu_seqlens_N1[j]:plan.cu_seqlens_N1[j + 1]]
            mask = plan.loss_mask_T[plan.cu_seqlens_N1[j]:plan.cu_seqlens_N1[j + 1]]
            eot = int(np.flatnonzero(ids == im_end)[-1])
            assert mask[eot] == 0 and mask[:eot].sum() >= 1, (row.record_id, mask[eot - 3:eot + 1])
            checked += 1
    assert checked >= 3, checked
