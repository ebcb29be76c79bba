"""Bad input loses nothing else: bad records are skipped and counted by reason while the job
finishes; a bad config is refused with a clear error before any model or GPU work."""

from __future__ import annotations

import json
import uuid

import pytest

from jobfixtures import clean_env, cli_json, closed_port_url, run_here

from hsx.records import SampleRow
from hsx.store import open_store

GOOD = {"conversations": [{"from": "human", "value": "What is 2 + 2?"}, {"from": "gpt", "value": "2 + 2 is 4, a small even number."}]}


def _good(i: int) -> dict:
    return {"id": f"good-{i}", **GOOD}


@pytest.fixture
def env(tmp_path, tiny_cache):
    return clean_env(cache_dir=tiny_cache, state_dir=tmp_path / "state", spool_dir=tmp_path / "spool")


def test_a_file_of_pathological_records_finishes_with_each_skip_counted(tmp_path, env, shared_worker):
    """Every docs/FACTS.md §4 pathology is skipped under its own reason; all good records are extracted."""
    lines = [json.dumps(_good(i)) for i in range(6)]
    lines += [
        '{"id": "broken", "conversations": [',                                              # malformed JSON
        json.dumps([1, 2, 3]),                                                              # not an object
        json.dumps({"id": "zero-turns", "conversations": []}),                              # no turns
        json.dumps({"id": "empty", "conversations": [{"from": "human", "value": ""}, {"from": "gpt", "value": "x y"}]}),
        json.dumps({"id": "invisible", "conversations": [{"from": "human", "value": "\u200b\u200b"}, {"from": "gpt", "value": "a b"}]}),
        json.dumps({"id": "alien", "conversations": [{"from": "martian", "value": "hi"}, {"from": "gpt", "value": "hello there"}]}),
        json.dumps({"id": "only-user", "conversations": [{"from": "human", "value": "anyone?"}]}),
        json.dumps({"id": "good-0", **GOOD}),                                               # duplicate id
        json.dumps({"id": "lead", "conversations": [{"from": "gpt", "value": "Hi! Ask me."}, {"from": "human", "value": "2+2?"},
                                                    {"from": "gpt", "value": "It is 4."}]}),  # leading assistant: repaired, kept
        json.dumps({"id": "bing", "conversations": [{"from": "human", "value": "hey"}, {"from": "bing", "value": "Hello from bing."}]}),
    ]
    data = tmp_path / "bad.jsonl"
    data.write_bytes(("\n".join(lines) + "\n").encode() + b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}]}\n')
    report = cli_json(shared_worker.producer(["run", str(data), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                                           "--max-length", "256", "--batch-tokens", "1024", "--json"], env))
    counts = report["plan"]["skipped"]["counts"]
    assert counts == {"malformed_json": 1, "not_an_object": 1, "no_turns": 1, "empty_turn": 2, "unknown_role": 1,
                      "no_assistant_turn": 1, "duplicate_id": 1, "invalid_utf8": 1}, counts
    assert report["plan"]["skipped"]["fixes"] == {"leading_assistant_dropped": 1}
    assert report["plan"]["samples"] == 8  # 6 good + the repaired one + bing normalised to assistant
    assert report["batches_done"] == report["batches_total"]
    samples = [row.record_id for row in SampleRow.read_all(open_store(report["address"]))]
    assert sorted(samples) == sorted([f"good-{i}" for i in range(6)] + ["lead", "bing"])


def test_every_skipped_example_of_a_jsonl_file_names_its_line_a_duplicate_id_too(tmp_path, tiny_cache):
    """The plan's skipped examples give each record's line, ``<id> (line N): ...``, whatever the reason:
    the duplicate id included (it was ``good-0: id ...`` with no line, unlike every other reason)."""
    from plans import plan_options, plan_settings
    from producer.planner import plan_run

    lines = [json.dumps(_good(i)) for i in range(3)]
    lines += [json.dumps({"id": "zero-turns", "conversations": []}), "",       # a blank line: lines are not records
              json.dumps(_good(1)), json.dumps({"id": "only-user", "conversations": [{"from": "human", "value": "hi"}]})]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(lines) + "\n")
    planned = plan_run(plan_options(tmp_path / "out", dataset=data, num_proc=1), plan_settings(tiny_cache))
    examples = planned.stats["skipped"]["examples"]
    assert set(examples) == {"duplicate_id", "no_turns", "no_assistant_turn"}, examples
    assert examples["duplicate_id"] == ["good-1 (line 6): id 'good-1' belongs to an earlier usable record of this file (chats.jsonl)"]
    assert examples["no_turns"][0].startswith("zero-turns (line 4): ") and examples["no_assistant_turn"][0].startswith(
        "only-user (line 7): "), examples


def _refused(proc, *needles: str) -> None:
    assert proc.returncode == 2, f"expected a refusal, got exit {proc.returncode}\n{proc.stderr[-2000:]}"
    flat = " ".join(proc.stderr.split())  # rich wraps long lines at the terminal width
    for needle in needles:
        assert needle in flat, f"{needle!r} not in:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr


def test_a_layer_id_out_of_range_is_refused_before_anything_is_written(tmp_path, env):
    """Layer 8 on an 8-layer model: exit 2, the rule named, no run written, no worker started."""
    out = tmp_path / "out"
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(out), "--layers", "1,8"], env)
    _refused(proc, "[8]", "out of range", "8 layers")
    assert not list(out.glob("*/run.json"))
    assert not (tmp_path / "state").exists(), "no broker or worker may start for a refused config"


def test_duplicate_layer_ids_are_refused(tmp_path, env):
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(tmp_path), "--layers", "1,2,2"], env)
    _refused(proc, "duplicates")


def test_a_batch_budget_smaller_than_one_sample_is_refused(tmp_path, env):
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(tmp_path),
                                "--max-length", "512", "--batch-tokens", "256"], env)
    _refused(proc, "--batch-tokens 256", "--max-length 512")


def test_a_batch_budget_that_is_not_positive_is_refused_as_such(tmp_path, env):
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(tmp_path / "out"),
                     "--batch-tokens", "-5"], env)
    _refused(proc, "--batch-tokens -5", "positive number of tokens", "default 32,768")
    assert not (tmp_path / "out").exists(), "a refused request leaves no empty output directory"


def test_an_unreachable_s3_endpoint_is_refused_with_its_address(tmp_path, env):
    """A closed port as S3 endpoint: exit 2 naming the endpoint, before any model work."""
    url = closed_port_url()
    env = dict(env, HSX_S3_ENDPOINT_URL=url, HSX_S3_ACCESS_KEY_ID="k", HSX_S3_SECRET_ACCESS_KEY="very-secret-key", HSX_S3_REGION="us-east-1")
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", "s3://bucket/x"], env)
    _refused(proc, url)
    assert "very-secret-key" not in proc.stderr + proc.stdout


def test_an_unreachable_broker_is_refused_before_planning(tmp_path, env):
    """enqueue against a broker URL nobody listens on: exit 2, URL shown with its password masked."""
    url = closed_port_url().replace("http://", "redis://:broker-secret@") + "/0"
    proc = run_here(["enqueue", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(tmp_path / "out")],
                   dict(env, HSX_BROKER_URL=url))
    _refused(proc, "does not answer")
    assert "broker-secret" not in proc.stderr + proc.stdout
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*/run.json"))


def test_enqueue_without_a_broker_url_says_how_to_set_one(tmp_path, env):
    proc = run_here(["enqueue", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(tmp_path)], env)
    _refused(proc, "HSX_BROKER_URL")


def test_a_400000_character_message_and_records_of_wrong_types_do_not_stop_the_job(tmp_path, env, shared_worker):
    """A 400,000-character reply is truncated to --max-length and extracted; records whose fields have the wrong JSON
    types are skipped under their reasons; every good record is extracted."""
    huge = {"id": "huge", "conversations": [{"from": "human", "value": "Say it all."}, {"from": "gpt", "value": "word " * 80_000}]}
    assert len(huge["conversations"][1]["value"]) == 400_000
    wrong = [
        {"id": "w-str-turns", "conversations": "not a list"},
        {"id": "w-dict-turns", "messages": {"role": "user", "content": "hi"}},
        {"id": "w-int-value", "conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x y"}]},
        {"id": "w-int-part", "messages": [{"role": "user", "content": ["a", 1]}, {"role": "assistant", "content": "ok then"}]},
        {"id": "w-null-turn", "conversations": [None, {"from": "gpt", "value": "ok"}]},
        {"id": "w-int-role", "conversations": [{"from": 3, "value": "x"}, {"from": "gpt", "value": "ok"}]},
        {"id": "w-dict-value", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": {"text": "a"}}]},
        {"id": "w-bool-value", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": True}]},
        {"id": "w-str-ids", "input_ids": "abc", "loss_mask": [1]},
        {"id": "w-float-ids", "input_ids": [1, 2.5, 3], "loss_mask": [0, 1, 1]},
    ]
    odd_ids = [{"id": 5, **GOOD}, {"id": ["a", "list"], **GOOD}]  # an int id is used as text; a list id falls back to the line
    data = tmp_path / "wrong.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [_good(0), _good(1), huge, *wrong, *odd_ids]) + "\n")
    report = cli_json(shared_worker.producer(["run", str(data), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"),
                                           "--max-length", "256", "--batch-tokens", "1024", "--json"], env))
    counts = report["plan"]["skipped"]["counts"]
    assert counts == {"no_turns": 2, "bad_turn": 6, "bad_pretokenised": 2}, counts
    assert report["plan"]["samples"] == 5 and report["plan"]["truncated_samples"] == 1
    assert report["batches_done"] == report["batches_total"]
    lines = [row.model_dump() for row in SampleRow.read_all(open_store(report["address"]))]
    by_id = {x["record_id"]: x for x in lines}
    assert by_id["huge"]["num_tokens"] == 256 and by_id["huge"]["truncated"], by_id["huge"]
    assert "5" in by_id


@pytest.mark.timeout(120)
def test_wrong_s3_credentials_are_refused_before_planning_without_printing_the_secret(tmp_path, env, secured_s3):
    """An S3 server that requires credentials, and a wrong secret: exit 2, 'credentials refused' and the fix; the secret is never printed."""
    secret = "wrong-secret-must-not-print"
    env = dict(env, HSX_S3_ENDPOINT_URL=secured_s3.endpoint_url, HSX_S3_ACCESS_KEY_ID=secured_s3.access_key,
               HSX_S3_SECRET_ACCESS_KEY=secret, HSX_S3_REGION="us-east-1")
    prefix = f"bad-input-{uuid.uuid4().hex[:8]}"
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", f"s3://guarded/{prefix}"],
                    env)
    _refused(proc, "credentials refused", "HSX_S3_SECRET_ACCESS_KEY", secured_s3.endpoint_url)
    assert secret not in proc.stderr + proc.stdout
    assert not (tmp_path / "state").exists(), "no broker or worker may start"
    from bench.servers import s3_client

    assert "Contents" not in s3_client(secured_s3.endpoint_url).list_objects_v2(Bucket="guarded", Prefix=prefix), "nothing written"


def test_an_output_that_is_a_run_is_refused_naming_its_parent(tmp_path, env):
    """--output pointing at a run (it holds run.json), as README examples spell runs ./out/<run_id>: exit 2, no run nested in it."""
    run_dir = tmp_path / "out" / "sharegpt-0123456789ab"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text("{}")
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(run_dir)], env)
    _refused(proc, "is a run", "give its parent")
    assert [p.name for p in run_dir.iterdir()] == ["run.json"], "nothing is written inside the run"


def test_an_output_that_is_a_file_is_refused_saying_so(tmp_path, env):
    """``--output`` naming a regular file (or a path under one): exit 2, the file named as a file, nothing else made."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    for output in (afile, afile / "runs"):
        proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--output", str(output)], env)
        said = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 2 and f"{afile} is a file, not a directory" in said, said
    assert afile.read_text() == "not a directory"


def test_a_negative_layer_id_is_refused_by_its_range_not_by_argparse(tmp_path, env):
    """``--layers -1,2`` (a value that starts with '-'): the layer range rule, not argparse's "expected one argument"."""
    proc = run_here(["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "5", "--layers", "-1,2",
                     "--output", str(tmp_path / "out")], env)
    said = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 2 and "out of range" in said and "expected one argument" not in said, said
