"""Issue 3, conversation shapes, through the CLI: tool calls, reasoning, pre-tokenised and text records
in one file become samples of one completed run, and the options that shape them are in run.json."""

from __future__ import annotations

import json

from jobfixtures import clean_env, cli_json, plan_samples

from hsx.runconfig import SamplePolicy, load_run
from hsx.records import SampleRow
from hsx.store import open_store

TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time in a zone",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}
RECORDS = [
    {"id": "tool-call", "tools": [TOOL], "messages": [
        {"role": "user", "content": "What time is it in UTC?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{\"tz\": \"UTC\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"},
        {"role": "assistant", "content": "It is noon in UTC."}]},
    {"id": "reasoning", "messages": [
        {"role": "user", "content": "Is 17 prime?"},
        {"role": "assistant", "reasoning_content": "17 has no divisor between 2 and 4.", "content": "Yes, 17 is prime."}]},
    {"id": "inline-think", "conversations": [
        {"from": "human", "value": "Is 21 prime?"},
        {"from": "gpt", "value": "<think>\n21 = 3 * 7.\n</think>\n\nNo, 21 = 3 x 7."}]},
    {"id": "pretokenised", "input_ids": [9707, 11, 1879, 0, 151645, 198], "loss_mask": [0, 0, 1, 1, 1, 0]},
    {"id": "text", "text": "Plain text: every token of it is a training target."},
]


def test_every_record_form_becomes_a_sample_of_a_completed_run(tmp_path, tiny_cache, shared_worker):
    """A tool-call conversation, two reasoning conversations, a pre-tokenised and a text record (--allow-text):
    all five planned and extracted; the pre-tokenised ids and mask are stored as given; run.json records
    enable_thinking and the sample policy."""
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool")
    data = tmp_path / "forms.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    report = cli_json(shared_worker.producer(["run", str(data), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                                           "--max-length", "256", "--batch-tokens", "1024", "--allow-text",
                                           "--enable-thinking", "--json"], env))
    assert report["plan"]["skipped"]["counts"] == {}, report["plan"]["skipped"]
    assert report["plan"]["samples"] == len(RECORDS)
    assert report["batches_done"] == report["batches_total"]

    run_store = open_store(report["address"])
    lines = [row.model_dump() for row in SampleRow.read_all(run_store)]
    assert sorted(s["record_id"] for s in lines) == sorted(r["id"] for r in RECORDS)
    by_id = {s["record_id"]: s for s in lines}
    assert by_id["pretokenised"]["num_tokens"] == 6 and by_id["pretokenised"]["supervised_tokens"] == 3
    text = by_id["text"]
    assert text["supervised_tokens"] == text["num_tokens"] > 5
    planned = plan_samples(run_store)[by_id["pretokenised"]["sample_index"]]
    assert planned["input_ids"].tolist() == RECORDS[3]["input_ids"]
    assert planned["loss_mask"].tolist() == RECORDS[3]["loss_mask"]

    config = load_run(run_store)
    assert config.tokenizer.enable_thinking is True
    assert config.sample_policy == SamplePolicy(over_length="truncate", allow_text=True, min_consecutive_supervised=2)
