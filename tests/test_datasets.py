"""Specifications of producer.datasets: streaming, normalisation and skip accounting on real files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hsx.errors import BadDataset
from producer import datasets
from producer.datasets import (
    SKIP_REASONS,
    Conversation,
    PretokenisedRecord,
    SkipCounter,
    TextRecord,
    dataset_files,
    ignored_dataset_files,
    iter_conversations,
    sharegpt_path,
)
from producer.sources import LocalFiles

SHAREGPT_COMPLETE_RECORDS = 17_671  # docs/FACTS.md §4


def _write_lines(path: Path, lines: list[bytes | str | object]) -> Path:
    """Write one JSON line per item: bytes as given, str as given, anything else json.dumps'd."""
    with open(path, "wb") as f:
        for item in lines:
            if isinstance(item, bytes):
                f.write(item)
            elif isinstance(item, str):
                f.write(item.encode("utf-8"))
            else:
                f.write(json.dumps(item).encode("utf-8"))
            f.write(b"\n")
    return path


def _sg(rid, *turns):
    """A ShareGPT record: turns are (from, value) pairs."""
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_streams_every_complete_record_and_reports_the_truncated_tail():
    """All 17,671 complete ShareGPT V3 records are either yielded or counted; the cut tail is reported."""
    skips = SkipCounter()
    convs = list(iter_conversations("sharegpt", skips))

    assert len(convs) + skips.total == SHAREGPT_COMPLETE_RECORDS, skips.as_dict()
    assert skips.truncated_bytes[str(sharegpt_path())] > 0
    assert set(skips.counts) <= set(SKIP_REASONS)
    # The export's repeated ids are an empty record then a real one: the real one is kept.
    assert "duplicate_id" not in skips.counts
    assert len({c.record_id for c in convs}) == len(convs)
    assert skips.fixes["leading_assistant_dropped"] > 6_000
    for conv in convs:
        roles = [m["role"] for m in conv.messages]
        assert "assistant" in roles
        assert set(roles) <= {"system", "user", "assistant", "tool"}
        first_non_system = next(r for r in roles if r != "system")
        assert first_non_system != "assistant", conv.record_id
    json.dumps(skips.as_dict())  # JSON-able


def test_every_pathology_is_counted_under_its_reason_and_every_good_record_is_yielded(tmp_path):
    """Each broken line is skipped with its own reason code; good and repaired records all come out."""
    good = _sg("good", ("human", "Hi"), ("gpt", "Hello!"))
    lines = [
        good,
        b'{"id": "cut", "conversations": [{"from": "human"',  # malformed_json
        b'{"id": "latin1", "conversations": [{"from": "human", "value": "caf\xe9"}, '
        b'{"from": "gpt", "value": "ok"}]}',  # invalid_utf8
        [1, 2, 3],  # not_an_object
        {"id": "noturns", "conversations": []},  # no_turns
        {"id": "nokey"},  # no_turns
        _sg("empty", ("human", "Q"), ("gpt", "")),  # empty_turn
        _sg("invisible", ("human", "\u200b\u200b \ufeff"), ("gpt", "A")),  # empty_turn
        _sg("narrator", ("human", "Q"), ("narrator", "A")),  # unknown_role
        _sg("roles", ("human", "q1"), ("bing", "a1"), ("user", "q2"), ("bard", "a2"),
            ("human", "q3"), ("chatgpt", "a3")),
        _sg("lead", ("system", "S"), ("gpt", "orphan reply"), ("human", "Q"), ("gpt", "A")),
        _sg("good", ("human", "another"), ("gpt", "record")),  # duplicate_id
        {"id": "turnstr", "conversations": ["just a string"]},  # bad_turn
        {"id": "nullcontent", "messages": [{"role": "user", "content": None},
                                           {"role": "assistant", "content": "A"}]},  # bad_turn
        _sg("onlyhuman", ("human", "anyone?")),  # no_assistant_turn
        {"id": 7, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two."}]},
            {"role": "assistant", "content": "Joined."},
        ]},
        _sg("escape", ("human", "lone \ud800 surrogate"), ("gpt", "A")),  # invalid_utf8 (JSON escape)
    ]
    path = _write_lines(tmp_path / "patho.jsonl", lines)
    skips = SkipCounter()
    convs = {c.record_id: c for c in iter_conversations(str(path), skips)}

    assert skips.counts == {
        "malformed_json": 1, "invalid_utf8": 2, "not_an_object": 1, "no_turns": 2, "empty_turn": 2,
        "unknown_role": 1, "duplicate_id": 1, "bad_turn": 2, "no_assistant_turn": 1,
    }
    assert list(convs) == ["good", "roles", "lead", "7"]
    (example,) = skips.examples["unknown_role"]
    assert example.startswith("narrator (line 9): turn 1 role 'narrator'; known roles: system, human, user, gpt, assistant"), example
    # a record's positional id counts records from 0; its example also names its 1-based line (a new user
    # read `file:N` as a line number and looked one line too early)
    assert skips.examples["not_an_object"][0].startswith("patho.jsonl:3 (line 4): a JSON list")
    # a record cut off mid-object is said at the end of its own line (its newline once made it "line 3, column 1")
    assert skips.examples["malformed_json"] == ["patho.jsonl:1 (line 2): at its end (the record is cut off): "
                                                "Expecting ',' delimiter"], skips.examples["malformed_json"]
    assert [m["role"] for m in convs["roles"].messages] == ["user", "assistant"] * 3
    assert convs["lead"].messages == (
        {"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
    )
    assert skips.fixes == {"leading_assistant_dropped": 1}
    # an id that is no string or integer: the record is kept under its position, and that is counted
    objid = _write_lines(tmp_path / "objid.jsonl", [{"id": {"x": 1}, "conversations": [{"from": "human", "value": "Q"},
                                                                                      {"from": "gpt", "value": "A"}]}])
    skips = SkipCounter()
    assert [c.record_id for c in iter_conversations(str(objid), skips)] == ["objid.jsonl:0"]
    assert skips.fixes == {"id_not_a_string_or_integer": 1}
    # a record with both a `messages` and a `conversations` list is read in OpenAI form, and that is counted
    both = _write_lines(tmp_path / "both.jsonl", [{"id": "b", "messages": [{"role": "user", "content": "Q"},
                                                                          {"role": "assistant", "content": "A"}],
                                                   "conversations": [{"from": "human", "value": "other"},
                                                                     {"from": "gpt", "value": "other"}]}])
    skips = SkipCounter()
    (conv,) = iter_conversations(str(both), skips)
    assert [m["content"] for m in conv.messages] == ["Q", "A"]
    assert skips.fixes == {"messages_used_conversations_ignored": 1}
    assert convs["7"].messages[0] == {"role": "user", "content": "Part one. Two."}
    assert convs["good"].messages[1] == {"role": "assistant", "content": "Hello!"}


def test_openai_tool_turns_keep_tool_calls_and_allow_null_content(tmp_path):
    """An assistant turn with tool_calls may have null content (becomes ""); tool_calls kept as given."""
    call = [{"type": "function", "function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]
    rec = {"id": "tools", "messages": [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": None, "tool_calls": call},
        {"role": "function", "content": "12:00"},
        {"role": "assistant", "content": "It is noon.", "reasoning_content": "read the tool"},
    ]}
    skips = SkipCounter()
    (conv,) = iter_conversations(str(_write_lines(tmp_path / "t.jsonl", [rec])), skips)
    assert conv.messages[1] == {"role": "assistant", "content": "", "tool_calls": call}
    assert conv.messages[2] == {"role": "tool", "content": "12:00"}
    assert conv.messages[3]["reasoning_content"] == "read the tool"
    assert skips.total == 0


def test_a_json_array_file_and_a_directory_are_read_in_sorted_file_order(tmp_path):
    """A .json array and a directory of files give the same records, files in name order, with file:index ids."""
    data = tmp_path / "data"
    data.mkdir()
    array = [_sg(None, ("human", "a"), ("gpt", "b")), "not an object", _sg("named", ("human", "c"), ("gpt", "d"))]
    (data / "b.json").write_text(json.dumps(array, indent=2))
    _write_lines(data / "a.jsonl", [_sg(None, ("human", "e"), ("gpt", "f"))])
    (data / "notes.txt").write_text("ignored")

    skips = SkipCounter()
    ids = [c.record_id for c in iter_conversations(str(data / "b.json"), skips)]
    assert ids == ["b.json:0", "named"]
    assert skips.counts == {"not_an_object": 1}
    assert skips.truncated_bytes == {}

    assert dataset_files(str(data)) == [data / "a.jsonl", data / "b.json"]
    ids = [c.record_id for c in iter_conversations(str(data), SkipCounter())]
    assert ids == ["a.jsonl:0", "b.json:0", "named"]
    # what is not read is named (the run's summary shows it as `not read`, run.json's dataset records it)
    (data / "more").mkdir()
    assert ignored_dataset_files(str(data)) == ["more/", "notes.txt"]
    assert LocalFiles(str(data)).describe()["ignored"] == ["more/", "notes.txt"]
    assert ignored_dataset_files(str(data / "a.jsonl")) == [] and "ignored" not in LocalFiles(str(data / "a.jsonl")).describe()


def test_streamed_json_array_equals_json_load_for_any_chunk_size(tmp_path, monkeypatch):
    """Chunk boundaries inside numbers, literals, escapes and multi-byte characters change nothing."""
    records = [
        {"id": i, "n": 12345.678e-3 * i, "flag": [True, False, None], "conversations": [
            {"from": "human", "value": f"caf\u00e9 \u4e2d\u6587 \U0001F600 \"q\" \\ {i}"},
            {"from": "gpt", "value": "\U0001F600 emoji, tab\t" * (i + 1)}]}
        for i in range(6)
    ]
    path = tmp_path / "arr.json"
    # The first half ASCII-escaped (the emoji becomes a surrogate-pair escape that a chunk may cut),
    # the second half raw UTF-8 (multi-byte characters that a chunk may cut).
    text = json.dumps(records[:3])[:-1] + ", " + json.dumps(records[3:], ensure_ascii=False)[1:]
    path.write_text(text, encoding="utf-8")
    assert json.loads(text) == records
    expected = [c.record_id for c in iter_conversations(str(path), SkipCounter())]
    assert expected == [str(i) for i in range(6)]
    for chunk in (1, 2, 3, 7, 64):
        monkeypatch.setattr(datasets, "READ_CHUNK_BYTES", chunk)
        convs = list(iter_conversations(str(path), SkipCounter()))
        assert [c.record_id for c in convs] == expected, chunk
        for i in (0, 5):
            assert convs[i].messages[0]["content"] == records[i]["conversations"][0]["value"]
            assert convs[i].messages[1]["content"] == records[i]["conversations"][1]["value"]


def test_a_json_array_cut_mid_record_yields_the_complete_records_and_counts_the_tail(tmp_path, monkeypatch):
    """A truncated array keeps every complete record and reports exactly the ignored tail bytes."""
    records = [_sg(f"r{i}", ("human", "q" * 50), ("gpt", "a\u00e9" * 50)) for i in range(5)]
    text = json.dumps(records, indent=1).encode("utf-8")
    cut = text.index(b'"r3"') + 20
    path = tmp_path / "cut.json"
    path.write_bytes(text[:cut])
    tail = text[text.rindex(b"{", 0, text.index(b'"r3"')):cut]
    monkeypatch.setattr(datasets, "READ_CHUNK_BYTES", 100)
    skips = SkipCounter()
    assert [c.record_id for c in iter_conversations(str(path), skips)] == ["r0", "r1", "r2"]
    assert skips.truncated_bytes == {str(path): len(tail)}
    assert skips.as_dict()["truncated_bytes"] == {str(path): len(tail)}


def test_invalid_utf8_inside_a_json_array_skips_only_that_record(tmp_path):
    """Bad bytes in one array element make that record invalid_utf8; its neighbours are kept."""
    good = json.dumps(_sg("a", ("human", "x"), ("gpt", "y"))).encode()
    bad = b'{"id": "b", "conversations": [{"from": "human", "value": "\xff\xfe"}, {"from": "gpt", "value": "y"}]}'
    last = json.dumps(_sg("c", ("human", "x"), ("gpt", "y"))).encode()
    path = tmp_path / "mixed.json"
    path.write_bytes(b"[" + good + b",\n" + bad + b",\n" + last + b"]")
    skips = SkipCounter()
    assert [c.record_id for c in iter_conversations(str(path), skips)] == ["a", "c"]
    assert skips.counts == {"invalid_utf8": 1}


def test_limit_stops_after_that_many_conversations(tmp_path):
    """limit counts yielded conversations, not records read."""
    path = _write_lines(tmp_path / "l.jsonl", [{"id": "x"}] + [_sg(f"r{i}", ("human", "q"), ("gpt", "a"))
                                                               for i in range(5)])
    skips = SkipCounter()
    assert [c.record_id for c in iter_conversations(str(path), skips, limit=2)] == ["r0", "r1"]
    assert skips.counts == {"no_turns": 1}


def test_unreadable_sources_raise_bad_dataset_naming_the_path_and_the_fix(tmp_path):
    """Missing path, unknown extension, empty directory, parquet without pyarrow: BadDataset with a fix."""
    with pytest.raises(BadDataset, match="does not exist"):
        dataset_files(str(tmp_path / "nope.jsonl"))
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(BadDataset, match=r"x\.csv.*\.csv.*convert"):
        dataset_files(str(tmp_path / "x.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadDataset, match="empty.*holds no"):
        dataset_files(str(tmp_path / "empty"))
    (tmp_path / "bad.json").write_text("hello")
    with pytest.raises(BadDataset, match="bad.json"):
        list(iter_conversations(str(tmp_path / "bad.json"), SkipCounter()))
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        (tmp_path / "d.parquet").write_bytes(b"PAR1")
        with pytest.raises(BadDataset, match="pip install pyarrow"):
            list(iter_conversations(str(tmp_path / "d.parquet"), SkipCounter()))


def test_conversation_is_frozen():
    """Conversations are immutable records (fields cannot be reassigned)."""
    conv = Conversation("x", ({"role": "user", "content": "q"},))
    with pytest.raises(AttributeError):
        conv.record_id = "y"  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Record forms (issue 3): tools, reasoning aliases, pre-tokenised and plain-text records


def test_record_level_tools_are_kept_as_given_or_parsed_from_a_json_string(tmp_path):
    """``tools`` (a list, or a JSON string of one) becomes Conversation.tools; anything else is bad_tools."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"},
            {"role": "assistant", "content": "a", "reasoning": "thought about it", "tool_calls": []}]
    lines = [
        {"id": "list", "tools": [tool], "messages": msgs},
        {"id": "string", "tools": json.dumps([tool]), "messages": msgs},
        {"id": "none", "tools": [], "messages": msgs},
        {"id": "not-json", "tools": "[{", "messages": msgs},
        {"id": "not-list", "tools": {"a": 1}, "messages": msgs},
        {"id": "bad-calls", "messages": [msgs[0], {"role": "assistant", "content": "x", "tool_calls": "f()"}]},
    ]
    skips = SkipCounter()
    convs = {c.record_id: c for c in iter_conversations(str(_write_lines(tmp_path / "t.jsonl", lines)), skips)}
    assert list(convs) == ["list", "string", "none"]
    assert convs["list"].tools == convs["string"].tools == (tool,)
    assert convs["none"].tools is None
    assert skips.counts == {"bad_tools": 2, "bad_turn": 1}
    assert convs["list"].messages[2] == {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "f"}
    # "reasoning" is read as reasoning_content; an empty tool_calls list (parquet's "none") is dropped.
    assert convs["list"].messages[3] == {"role": "assistant", "content": "a", "reasoning_content": "thought about it"}


def test_pretokenised_records_are_checked_for_shape_and_kept_as_arrays(tmp_path):
    """input_ids + loss_mask of equal length, integers, ids >= 0, mask 0/1; each violation is bad_pretokenised
    with the detail (the lengths for a length mismatch)."""
    lines = [
        {"id": "good", "input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]},
        {"input_ids": [5, 6], "loss_mask": [True, True]},  # no id: file:index; bool mask accepted
        {"id": "lengths", "input_ids": [1, 2, 3], "loss_mask": [1, 1]},
        {"id": "floats", "input_ids": [1.5, 2], "loss_mask": [1, 1]},
        {"id": "strings", "input_ids": ["a", "b"], "loss_mask": [1, 1]},
        {"id": "negative", "input_ids": [1, -2], "loss_mask": [1, 1]},
        {"id": "mask2", "input_ids": [1, 2], "loss_mask": [1, 2]},
        {"id": "only-ids", "input_ids": [1, 2]},
        {"id": "empty", "input_ids": [], "loss_mask": []},
        {"id": "nested", "input_ids": [[1, 2]], "loss_mask": [[1, 1]]},
        {"id": "good", "input_ids": [1, 2], "loss_mask": [1, 1]},  # duplicate id
    ]
    skips = SkipCounter()
    recs = list(iter_conversations(str(_write_lines(tmp_path / "p.jsonl", lines)), skips))
    assert [type(r) for r in recs] == [PretokenisedRecord, PretokenisedRecord]
    assert [r.record_id for r in recs] == ["good", "p.jsonl:1"]
    assert recs[0].input_ids.dtype == np.int64 and recs[0].input_ids.tolist() == [1, 2, 3, 4]
    assert recs[0].loss_mask.dtype == np.uint8 and recs[0].loss_mask.tolist() == [0, 1, 1, 1]
    assert recs[1].loss_mask.tolist() == [1, 1]
    assert skips.counts == {"bad_pretokenised": 8, "duplicate_id": 1}
    examples = skips.examples["bad_pretokenised"]
    assert examples[0] == "lengths (line 3): input_ids has 3 tokens, loss_mask 2 values: they must have equal length"
    assert examples[1].startswith("floats (line 4): 'input_ids' must be a flat list of integers")
    assert examples[3] == "negative (line 6): input_ids[1] = -2: token ids must be >= 0"
    assert examples[4] == "mask2 (line 7): loss_mask[1] = 2: must be 0 or 1"


def test_text_records_are_used_only_when_allowed(tmp_path):
    """Without allow_text a {"text": ...} record is skipped text_not_allowed; with it, a TextRecord."""
    lines = [{"id": "t", "text": "Hello world."}, {"id": "blank", "text": " \u200b "}, {"id": "num", "text": 3},
             _sg("chat", ("human", "q"), ("gpt", "a"))]
    path = str(_write_lines(tmp_path / "x.jsonl", lines))
    skips = SkipCounter()
    assert [r.record_id for r in iter_conversations(path, skips)] == ["chat"]
    assert skips.counts == {"text_not_allowed": 3}
    assert skips.examples["text_not_allowed"][0] == ("t (line 1): a plain-text record: pass --allow-text to train on "
                                                     "every token of such records")
    skips = SkipCounter()
    recs = list(iter_conversations(path, skips, allow_text=True))
    assert recs[0] == TextRecord("t", "Hello world.") and isinstance(recs[1], Conversation)
    assert skips.counts == {"empty_turn": 1, "bad_turn": 1}


def test_llama_factory_sharegpt_records_keep_their_system_prompt_and_tool_turns(tmp_path):
    """LLaMA-Factory's ShareGPT form: a record-level ``system`` string is the system prompt (unless the
    turns open with their own), ``function_call`` turns are the assistant's tool calls and
    ``observation`` turns the tools' results; OpenAI's ``developer`` role is the system role."""
    call = {"name": "get_time", "arguments": {"tz": "UTC"}}
    rec = {"id": "lf", "system": "You are a pirate.", "hsx_supervised_turns": [3], "conversations": [
        {"from": "human", "value": "time?"},
        {"from": "function_call", "value": json.dumps(call)},
        {"from": "observation", "value": "12:00"},
        {"from": "gpt", "value": "Noon, matey."},
    ]}
    own_system = {"id": "own", "system": "ignored", "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}]}
    skips = SkipCounter()
    lf, own = iter_conversations(str(_write_lines(tmp_path / "lf.jsonl", [rec, own_system])), skips)
    assert lf.messages == (
        {"role": "system", "content": "You are a pirate."},
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Noon, matey."},
    )
    assert lf.supervised_turns == {4}, "the record's turn indices move with the system prompt put before them"
    assert own.messages[0] == {"role": "system", "content": "Be brief."}
    assert skips.total == 0 and skips.fixes == {"system_field_used": 1, "system_field_ignored_for_system_turn": 1}


def test_an_assistant_turn_that_only_calls_tools_may_leave_content_out_and_an_empty_id_is_no_id(tmp_path):
    """OpenAI's form leaves ``content`` out of a turn with ``tool_calls``: kept, as with ``content: null``.
    An id that is "" or blank stands for no id (a column of empty ids would keep one record of them)."""
    call = [{"type": "function", "function": {"name": "f", "arguments": {}}}]
    recs = [{"id": "", "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "tool_calls": call},
                                    {"role": "tool", "content": "done"}, {"role": "assistant", "content": "ok"}]},
            {"id": " ", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}]
    skips = SkipCounter()
    first, second = iter_conversations(str(_write_lines(tmp_path / "e.jsonl", recs)), skips)
    assert first.messages[1] == {"role": "assistant", "content": "", "tool_calls": call}
    assert (first.record_id, second.record_id) == ("e.jsonl:0", "e.jsonl:1")
    assert skips.total == 0 and skips.fixes == {"id_empty": 2}


def test_ids_are_unique_within_a_file_and_a_directory_s_files_may_repeat_each_other_s(tmp_path):
    """Two shards that each number their records from 0: the second's records keep their content under
    ``<file>/<id>``; a repeat inside one file is still a duplicate_id, named with its file."""
    (tmp_path / "d").mkdir()
    _write_lines(tmp_path / "d" / "a.jsonl", [_sg(i, ("human", f"a{i}"), ("gpt", "x")) for i in range(3)])
    _write_lines(tmp_path / "d" / "b.jsonl", [_sg(i, ("human", f"b{i}"), ("gpt", "y")) for i in (0, 1, 7, 1)])
    skips = SkipCounter()
    convs = list(iter_conversations(str(tmp_path / "d"), skips))
    assert [c.record_id for c in convs] == ["0", "1", "2", "b.jsonl/0", "b.jsonl/1", "7"]
    assert [c.messages[0]["content"] for c in convs] == ["a0", "a1", "a2", "b0", "b1", "b7"]
    assert skips.counts == {"duplicate_id": 1} and skips.fixes == {"id_scoped_by_file": 2}
    assert "this file (b.jsonl" in skips.examples["duplicate_id"][0]


def test_a_misspelt_hsx_key_skips_its_record_naming_the_keys_hsx_reads(tmp_path):
    """``hsx_supervised_turn`` (singular) would leave every assistant turn supervised with no word: the
    record is skipped as ``unknown_hsx_key``, naming the key and the ones hsx reads; the others are kept."""
    good = {"id": "ok", "hsx_supervised_turns": [1], "messages": [{"role": "user", "content": "q"},
                                                                 {"role": "assistant", "content": "a"}]}
    typo = dict(good, id="typo", hsx_supervised_turn=[1])
    del typo["hsx_supervised_turns"]
    upper = dict(good, id="upper", HSX_supervised_turns=[1])
    del upper["hsx_supervised_turns"]
    skips = SkipCounter()
    (kept,) = iter_conversations(str(_write_lines(tmp_path / "k.jsonl", [good, typo, upper])), skips)
    assert kept.record_id == "ok" and skips.counts == {"unknown_hsx_key": 2}
    assert skips.examples["unknown_hsx_key"][0] == (
        "typo (line 2): 'hsx_supervised_turn' is not a key hsx reads (it reads hsx_supervised_turns, "
        "hsx_unfinished_turns): fix its spelling or remove it")
    assert skips.examples["unknown_hsx_key"][1].startswith("upper (line 3): 'HSX_supervised_turns' is not a key")


def test_a_parquet_file_gives_the_tool_schemas_and_calls_its_json_lines_give(tmp_path):
    """Arrow stores a column of structs with every record's keys, null where a record had none: read
    back, one record's tool schema held another's parameter as ``null`` and the template rendered it.
    The records of a Parquet file equal those of the same JSON lines."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def record(rid, param, args):
        tool = {"type": "function", "function": {"name": f"f_{param}", "parameters": {
            "type": "object", "properties": {param: {"type": "string"}}}}}
        return {"id": rid, "tools": [tool], "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                "name": f"f_{param}", "arguments": args}}]},
            {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "done"}]}

    recs = [record("a", "city", {"city": "Paris"}), record("b", "query", {"query": "x"})]
    pq.write_table(pa.Table.from_pylist(recs), tmp_path / "t.parquet")
    from_parquet = list(iter_conversations(str(tmp_path / "t.parquet"), SkipCounter()))
    from_lines = list(iter_conversations(str(_write_lines(tmp_path / "t.jsonl", recs)), SkipCounter()))
    assert [(c.record_id, c.messages, c.tools) for c in from_parquet] == \
        [(c.record_id, c.messages, c.tools) for c in from_lines]


def test_a_name_given_to_a_record_never_takes_another_record_s_id_and_generated_ids_are_never_dropped(tmp_path):
    """The three collisions a new user built: a later record whose own id is the name given to an earlier one
    (``b.jsonl/0``), a name already taken by another file's own id, and an own id equal to a generated
    ``<file>:<index>``. Each record is kept under a name no other record has."""
    def rec(rid, text):
        out = {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]}
        return out if rid is None else {"id": rid, **out}

    (tmp_path / "d").mkdir()
    _write_lines(tmp_path / "d" / "a.jsonl", [rec(0, "a0"), rec("b.jsonl/1", "a-literal"), rec("a.jsonl:3", "a-own"),
                                              rec(None, "a-no-id"), rec(1, "a1")])
    _write_lines(tmp_path / "d" / "b.jsonl", [rec(0, "b0"), rec("b.jsonl/0", "b-literal"), rec(1, "b1"),
                                              rec(1, "b1-again")])
    skips = SkipCounter()
    convs = list(iter_conversations(str(tmp_path / "d"), skips))
    ids = {c.messages[0]["content"]: c.record_id for c in convs}
    assert ids == {"a0": "0", "a-literal": "b.jsonl/1", "a-own": "a.jsonl:3", "a-no-id": "a.jsonl/a.jsonl:3",
                   "a1": "1", "b0": "b.jsonl/0", "b-literal": "b.jsonl/b.jsonl/0", "b1": "b.jsonl/1#2"}, ids
    assert skips.counts == {"duplicate_id": 1} and skips.examples["duplicate_id"][0].startswith("1 (line 4)")
