"""``python -m producer export``: each format loads back with the tensor names, shapes and dtypes
its trainer reads (producer/export.py says where each was matched), with the values the shards
hold; ``vocab_counts.safetensors`` counts exactly the supervised tokens. The trainers' released
code reads these exports in ``scripts/compat.sh`` (their own venvs; README, "Trainer compatibility")."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

from jobfixtures import cli_json, read_samples, run_here
from smallrun import copy_run

from hsx.errors import BadConfig
from hsx.runconfig import load_run
from hsx.records import SampleRow
from hsx.store import open_store
from producer.export import check_exportable, export_run, file_stem, supervised_token_counts

K, H = 3, 64


@pytest.fixture(scope="module")
def stored(small_run):
    """Every stored sample of the shared run, keyed by sample_index (read straight from the shards)."""
    return read_samples(open_store(small_run["address"]))


def _supervised(stored: dict) -> int:
    return sum(int(s["loss_mask"].sum()) for s in stored.values())


def _check_vocab_counts(path, stored: dict) -> np.ndarray:
    counts = load_numpy(str(path))["counts"]
    assert counts.dtype == np.int64 and counts.ndim == 1 and counts.shape[0] >= 151_669
    assert counts.sum() == _supervised(stored)
    ids = np.concatenate([s["input_ids"].numpy()[s["loss_mask"].numpy() == 1] for s in stored.values()])
    assert np.array_equal(counts, np.bincount(ids, minlength=counts.shape[0]))
    return counts


def _index(out) -> list[int]:
    return json.loads((out / "export.json").read_text())["sample_index"]


def test_specforge_eagle3_export_loads_as_data_ckpt_files_under_row_range_folders(small_run, stored, tmp_path):
    """CLI export: rows_0-2000/data_{i}.ckpt, each {input_ids int64 [S], loss_mask int64 [S],
    hidden_state bf16 [1,S,H] = final post-norm, aux_hidden_state bf16 [1,S,3H] = the 3 layers}."""
    out = tmp_path / "eagle3"
    report = cli_json(run_here(["export", small_run["address"], "--format", "specforge-eagle3", str(out), "--json"],
                              small_run["env"]))
    assert report["samples"] == len(stored) and report["supervised_tokens"] == _supervised(stored)
    index = _index(out)
    assert sorted(index) == sorted(stored)
    files = sorted(out.glob("rows_*/data_*.ckpt"))
    assert {f.parent.name for f in files} == {"rows_0-2000"} and len(files) == len(stored)
    for i, sample in enumerate(index):
        rec = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        assert set(rec) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert rec["input_ids"].dtype == torch.int64 and rec["input_ids"].shape == (S,)
        assert rec["loss_mask"].dtype == torch.int64 and rec["loss_mask"].shape == (S,)
        assert rec["hidden_state"].dtype == torch.bfloat16 and rec["hidden_state"].shape == (1, S, H)
        assert rec["aux_hidden_state"].dtype == torch.bfloat16 and rec["aux_hidden_state"].shape == (1, S, 3 * H)
        assert torch.equal(rec["input_ids"], ref["input_ids"].long()) and torch.equal(rec["loss_mask"], ref["loss_mask"].long())
        assert torch.equal(rec["hidden_state"][0], ref["final_postnorm"])
        assert torch.equal(rec["aux_hidden_state"][0], torch.cat([ref["hidden_states"][:, k] for k in range(K)], dim=-1))
        # Each file holds its own sample only, not the storage of the whole shard it was sliced from.
        data_bytes = sum(t.numel() * t.element_size() for t in rec.values())
        stored_bytes = sum(t.untyped_storage().nbytes() for t in rec.values())
        assert stored_bytes == data_bytes, f"sample {sample}: {stored_bytes} bytes of storage for {data_bytes} bytes of data"
        assert (out / "rows_0-2000" / f"data_{i}.ckpt").stat().st_size < data_bytes + 64 * 1024
    _check_vocab_counts(out / "vocab_counts.safetensors", stored)


def test_specforge_dflash_export_holds_hidden_states_in_target_layer_order(small_run, stored, tmp_path):
    """data_{i}.ckpt with {input_ids, loss_mask int64 [S], hidden_states bf16 [1,S,K*H]}; group folders of --group-size."""
    out = tmp_path / "dflash"
    report = export_run(open_store(small_run["address"]), "specforge-dflash", out, group_size=4)
    assert report["final"] == "none" and report["layer_ids"] == [1, 3, 4]
    index = _index(out)
    for i, sample in enumerate(index):
        g = i // 4 * 4
        rec = torch.load(out / f"rows_{g}-{g + 4}" / f"data_{i}.ckpt", weights_only=True)
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        assert set(rec) == {"input_ids", "loss_mask", "hidden_states"}
        assert rec["input_ids"].dtype == torch.int64 and rec["loss_mask"].dtype == torch.int64
        assert rec["hidden_states"].dtype == torch.bfloat16 and rec["hidden_states"].shape == (1, S, K * H)
        assert torch.equal(rec["hidden_states"][0].view(S, K, H), ref["hidden_states"])
    _check_vocab_counts(out / "vocab_counts.safetensors", stored)


def test_speculators_export_is_an_arrow_table_with_hs_safetensors_and_token_freq(small_run, stored, tmp_path):
    """Arrow rows (input_ids, loss_mask, seq_len) + hidden_states/hs_{i}.safetensors {hidden_states
    bf16 [S, K+1, H]: the layers then the final state BEFORE the norm, token_ids int64 [S]} + token_freq.pt."""
    import pyarrow as pa

    out = tmp_path / "speculators"
    report = export_run(open_store(small_run["address"]), "speculators", out)
    assert report["vllm_layer_ids"] == [2, 4, 5, 8]
    with pa.OSFile(str(out / "data-00000-of-00001.arrow")) as f:
        table = pa.ipc.open_stream(f).read_all()
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert table.schema.field("input_ids").type == pa.list_(pa.int64()) and table.schema.field("seq_len").type == pa.int64()
    state = json.loads((out / "state.json").read_text())
    assert state["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}]
    assert state["_format_type"] == "torch", "ArrowDataset compares rows with torch.equal: they must load as tensors"
    assert (out / "dataset_info.json").is_file()
    index = _index(out)
    assert table.num_rows == len(index) == len(stored)
    rows = table.to_pylist()
    for i, sample in enumerate(index):
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert set(hs) == {"hidden_states", "token_ids"}
        assert hs["hidden_states"].dtype == torch.bfloat16 and hs["hidden_states"].shape == (S, K + 1, H)
        assert hs["token_ids"].dtype == torch.int64 and hs["token_ids"].tolist() == rows[i]["input_ids"]
        assert rows[i]["seq_len"] == S and rows[i]["loss_mask"] == ref["loss_mask"].tolist()
        assert torch.equal(hs["hidden_states"][:, :K], ref["hidden_states"])
        assert torch.equal(hs["hidden_states"][:, K], ref["final_prenorm"])
    freq = torch.load(out / "token_freq.pt", weights_only=True)
    counts = _check_vocab_counts(out / "vocab_counts.safetensors", stored)
    assert isinstance(freq, dict) and sum(freq.values()) == _supervised(stored)
    assert all(counts[t] == c for t, c in freq.items())


def test_speculators_export_loads_with_datasets_load_from_disk(small_run, tmp_path):
    """load_from_disk gives torch int64 rows, so speculators' ArrowDataset check
    ``torch.equal(hs["token_ids"], data[i]["input_ids"])`` holds for every sample (speculators 0.9.0,
    train/data.py); state.json is what datasets itself writes after set_format("torch") + save_to_disk."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "speculators"
    export_run(open_store(small_run["address"]), "speculators", out)
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == len(_index(out))
    for i in range(len(ds)):
        row = ds[i]
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert isinstance(row["input_ids"], torch.Tensor) and row["input_ids"].dtype == torch.int64
        assert torch.equal(hs["token_ids"], row["input_ids"]), f"sample {i}: token_ids differ from the table's input_ids"
        assert row["loss_mask"].dtype == torch.int64 and row["loss_mask"].shape == row["input_ids"].shape
        assert int(row["seq_len"]) == hs["hidden_states"].shape[0]

    reference = tmp_path / "reference"
    made = datasets.Dataset.from_dict({"input_ids": [[1, 2]], "loss_mask": [[0, 1]], "seq_len": [2]})
    made.set_format("torch")
    made.save_to_disk(str(reference))
    ours, theirs = (json.loads((d / "state.json").read_text()) for d in (out, reference))
    assert {k: v for k, v in ours.items() if k != "_fingerprint"} == {k: v for k, v in theirs.items() if k != "_fingerprint"}


def test_vocab_counts_subcommand_writes_the_runs_counts(small_run, stored, tmp_path):
    """`vocab-counts --output FILE`: counts of input ids at loss_mask == 1 over every stored sample."""
    target = tmp_path / "counts.safetensors"
    info = cli_json(run_here(["vocab-counts", small_run["address"], "--output", str(target), "--json"], small_run["env"]))
    assert info["supervised_tokens"] == _supervised(stored) and info["samples"] == len(stored)
    _check_vocab_counts(target, stored)


def test_formats_refuse_runs_without_what_their_trainer_needs(small_run, tmp_path):
    """EAGLE-3 needs exactly 3 layers and the post-norm final; speculators the pre-norm final; the CLI exits 2 with the fix."""
    config = load_run(open_store(small_run["address"]))

    def variant(**layers):
        return dataclasses.replace(config, layers=type(config.layers).model_validate({**config.layers.model_dump(), **layers}))

    with pytest.raises(BadConfig, match="exactly the 3 EAGLE layers"):
        check_exportable(variant(layer_ids=[1, 2, 3, 4, 5]), "specforge-eagle3")
    with pytest.raises(BadConfig, match="AFTER the norm"):
        check_exportable(variant(final="prenorm"), "specforge-eagle3")
    with pytest.raises(BadConfig, match="BEFORE the norm"):
        check_exportable(variant(final="postnorm"), "speculators")
    assert check_exportable(variant(final="none", layer_ids=[1, 2, 3, 4, 5]), "specforge-dflash") == []
    assert check_exportable(variant(layer_ids=[0, 3, 4]), "specforge-eagle3"), "non-default EAGLE ids are warned about"

    run_dir = copy_run(small_run, tmp_path)
    run_json = json.loads((run_dir / "run.json").read_text())
    run_json["layers"]["final"] = "postnorm"
    (run_dir / "run.json").write_text(json.dumps(run_json))
    proc = run_here(["export", str(run_dir), "--format", "speculators", str(tmp_path / "x")], small_run["env"])
    assert proc.returncode == 2 and "BEFORE the norm" in proc.stderr and "--final prenorm" in proc.stderr
    assert not (tmp_path / "x").exists(), "a refused export leaves nothing behind"


def test_incomplete_runs_and_non_empty_targets_are_refused_unless_partial(small_run, tmp_path):
    """A run with a batch not done exports only with partial=True (and says so); a non-empty OUT is refused."""
    run_dir = copy_run(small_run, tmp_path)
    (run_dir / "markers" / "b000002.json").unlink()
    run_store = open_store(str(run_dir))
    with pytest.raises(BadConfig, match="--partial"):
        export_run(run_store, "specforge-dflash", tmp_path / "a")
    report = export_run(run_store, "specforge-dflash", tmp_path / "b", partial=True)
    counts, info = supervised_token_counts(run_store)
    assert report["samples"] == info["samples"] < small_run["report"]["plan"]["samples"]
    assert any("partial" in w for w in report["warnings"])
    with pytest.raises(BadConfig, match="not an empty directory"):
        export_run(run_store, "specforge-dflash", tmp_path / "b", partial=True)


def test_specforge_dspark_export_adds_the_post_norm_final_state_aligned_to_input_ids(small_run, stored, tmp_path):
    """data_{i}.ckpt with the DFlash keys plus target_last_hidden_states bf16 [1, S, H] = final post-norm
    (SpecForge 0.2.0 normalize_dspark_offline_sample: same S as input_ids)."""
    out = tmp_path / "dspark"
    report = export_run(open_store(small_run["address"]), "specforge-dspark", out)
    assert report["final"].startswith("postnorm")
    index = _index(out)
    assert sorted(index) == sorted(stored) and len(list(out.glob("rows_*/data_*.ckpt"))) == len(stored)
    for i, sample in enumerate(index):
        rec = torch.load(out / "rows_0-2000" / f"data_{i}.ckpt", weights_only=True)
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        assert set(rec) == {"input_ids", "loss_mask", "hidden_states", "target_last_hidden_states"}
        assert rec["target_last_hidden_states"].dtype == torch.bfloat16 and rec["target_last_hidden_states"].shape == (1, S, H)
        assert torch.equal(rec["target_last_hidden_states"][0], ref["final_postnorm"])
        assert torch.equal(rec["hidden_states"][0].view(S, K, H), ref["hidden_states"])
        assert torch.equal(rec["input_ids"], ref["input_ids"].long()) and torch.equal(rec["loss_mask"], ref["loss_mask"].long())
    _check_vocab_counts(out / "vocab_counts.safetensors", stored)


def test_eagle_ge_data_export_holds_only_data_files_without_a_batch_axis(small_run, stored, tmp_path):
    """OUT/ge_data/rows_*/data_{i}.ckpt, each {input_ids int64 [S], hidden_state bf16 [S, H] = final
    post-norm, loss_mask int64 [S]}; EAGLE-1/2's trainer loads every file under --tmpdir, so
    ge_data/ holds nothing else (export.json and the counts sit beside it)."""
    out = tmp_path / "eagle"
    report = export_run(open_store(small_run["address"]), "eagle-ge-data", out, group_size=5)
    assert any("final state only" in w for w in report["warnings"])
    files = sorted(p for p in (out / "ge_data").rglob("*") if p.is_file())
    assert len(files) == len(stored) and all(f.name.startswith("data_") and f.suffix == ".ckpt" for f in files)
    assert (out / "export.json").is_file() and (out / "vocab_counts.safetensors").is_file()
    for i, sample in enumerate(_index(out)):
        g = i // 5 * 5
        rec = torch.load(out / "ge_data" / f"rows_{g}-{g + 5}" / f"data_{i}.ckpt", weights_only=True)
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        assert set(rec) == {"input_ids", "hidden_state", "loss_mask"}
        assert rec["input_ids"].dtype == torch.int64 and rec["input_ids"].shape == (S,)
        assert rec["loss_mask"].dtype == torch.int64 and rec["loss_mask"].shape == (S,)
        assert rec["hidden_state"].dtype == torch.bfloat16 and rec["hidden_state"].shape == (S, H)
        assert torch.equal(rec["hidden_state"], ref["final_postnorm"])
        assert torch.equal(rec["input_ids"], ref["input_ids"].long()) and torch.equal(rec["loss_mask"], ref["loss_mask"].long())


def test_modelopt_export_writes_one_pt_per_conversation_named_by_its_record_id(small_run, stored, tmp_path):
    """OUT/{conversation_id}.pt with input_ids int64 [S], hidden_states bf16 [S, H] = final post-norm,
    aux_hidden_states bf16 [S, K*H] (layers in id order), loss_mask int64 [S] and conversation_id =
    the record id of the plan's sample rows (ModelOpt 0.47.0 OfflineSupervisedDataset)."""
    out = tmp_path / "modelopt"
    report = export_run(open_store(small_run["address"]), "modelopt", out)
    assert report["warnings"] == [], "the shared run has ModelOpt's default EAGLE ids"
    record_id = {row.sample_index: row.record_id for row in SampleRow.read_all(open_store(small_run["address"]))}
    files = sorted(out.glob("*.pt"))
    assert len(files) == len(stored) == len(_index(out))
    seen = set()
    for path in files:
        rec = torch.load(path, weights_only=True)
        assert set(rec) == {"input_ids", "hidden_states", "aux_hidden_states", "loss_mask", "conversation_id"}
        sample = next(s for s, rid in record_id.items() if rid == rec["conversation_id"])
        assert path.stem == file_stem(rec["conversation_id"]) and sample in stored
        seen.add(sample)
        ref = stored[sample]
        S = ref["input_ids"].shape[0]
        assert rec["hidden_states"].dtype == torch.bfloat16 and rec["hidden_states"].shape == (S, H)
        assert rec["aux_hidden_states"].dtype == torch.bfloat16 and rec["aux_hidden_states"].shape == (S, K * H)
        assert torch.equal(rec["hidden_states"], ref["final_postnorm"])
        assert torch.equal(rec["aux_hidden_states"], torch.cat([ref["hidden_states"][:, k] for k in range(K)], dim=-1))
        assert rec["input_ids"].dtype == torch.int64 and torch.equal(rec["input_ids"], ref["input_ids"].long())
        assert rec["loss_mask"].dtype == torch.int64 and torch.equal(rec["loss_mask"], ref["loss_mask"].long())
    assert seen == set(stored)


def test_file_stems_keep_safe_ids_and_encode_the_rest_without_collisions():
    """A record id is its own file name when it is [A-Za-z0-9_.-] without a leading dot; any other
    character becomes %XX of its UTF-8 bytes ('%' too), so distinct ids never share a name, and
    very long ids are cut to a bounded name with a hash of the whole id."""
    assert file_stem("QWJhYvA_0") == "QWJhYvA_0" and file_stem("conv-12.v2") == "conv-12.v2"
    assert file_stem("chats.jsonl:3") == "chats.jsonl%3A3"
    assert file_stem("a/b") == "a%2Fb" and file_stem("..") == "%2E." and file_stem(".hidden") == "%2Ehidden"
    assert file_stem("é") == "%C3%A9" and file_stem("100%") == "100%25" and file_stem("a b") == "a%20b"
    ids = ["a/b", "a%2Fb", "a:b", "a%3Ab", "A", "a", ".a", "%2Ea", "x" * 300, "x" * 299 + "y", "é", "%C3%A9"]
    stems = [file_stem(i) for i in ids]
    assert len(set(stems)) == len(ids), dict(zip(ids, stems))
    assert all(len(st) <= 200 and "/" not in st and not st.startswith(".") for st in stems)


def test_new_formats_refuse_runs_without_the_post_norm_final_state(small_run):
    """DSpark, ge_data and ModelOpt all read the state after the final norm; a run without it is refused
    with the fix; ModelOpt warns when the layers are not its EAGLE default."""
    config = load_run(open_store(small_run["address"]))

    def variant(**layers):
        return dataclasses.replace(config, layers=type(config.layers).model_validate({**config.layers.model_dump(), **layers}))

    for fmt in ("specforge-dspark", "eagle-ge-data", "modelopt"):
        with pytest.raises(BadConfig, match="AFTER the norm.*--final postnorm"):
            check_exportable(variant(final="prenorm"), fmt)
        check_exportable(variant(final="postnorm"), fmt)
    assert check_exportable(variant(final="postnorm", layer_ids=[1, 2, 3, 4, 5]), "specforge-dspark") == []
    assert any("ModelOpt's EAGLE default" in w for w in check_exportable(variant(layer_ids=[0, 3, 4]), "modelopt"))


def test_the_compatibility_script_checks_every_export_format():
    """scripts/compat.sh exports every format in producer.export.FORMATS and hands each to one
    consumer's check (README, "Trainer compatibility"), and is valid bash."""
    import re
    import subprocess
    from pathlib import Path

    from producer.export import FORMATS

    script = Path(__file__).resolve().parents[1] / "scripts" / "compat.sh"
    text = script.read_text()
    exported = re.search(r"^FORMATS=\((.*)\)$", text, re.M).group(1).split()
    checked = [f for line in re.findall(r"^check (\S+) (.*)$", text, re.M) for f in line[1].split()]
    assert sorted(exported) == sorted(FORMATS) == sorted(checked)
    for consumer, _ in re.findall(r"^check (\S+) (.*)$", text, re.M):
        assert (script.parent / f"compat_{consumer}.py").is_file(), consumer
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("existing", [False, True], ids=["new-directory", "empty-directory"])
def test_ctrl_c_during_export_says_that_nothing_of_it_is_left(small_run, tmp_path, monkeypatch, existing):
    """Issue 22 item 6: a SIGINT once the first sample file is written stops ``producer export`` with exit 130
    and a line about the export (not ``run``'s markers): the directory it made is gone, an empty one it
    was given is empty again, and the run is as it was."""
    import os
    import signal

    from producer import interrupts

    target = tmp_path / "eagle3-data"
    if existing:
        target.mkdir()
    real_save = torch.save
    interrupted = threading.Event()

    def save_then_interrupt(*args, **kwargs):
        real_save(*args, **kwargs)
        if interrupted.is_set():  # one Ctrl-C: a second SIGINT from another writer could land after the CLI returned
            return
        interrupted.set()
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C in the middle of the export
        if threading.current_thread() is not threading.main_thread():
            # a writer thread: the export stays unfinished until the main thread has taken the signal (a
            # fixed 1 s sleep was not enough on a loaded machine: the export finished first and exited 0)
            deadline = time.monotonic() + 60
            while interrupts.received() is None and time.monotonic() < deadline:
                time.sleep(0.01)

    monkeypatch.setattr(torch, "save", save_then_interrupt)
    before = sorted(p.relative_to(small_run["dir"]) for p in small_run["dir"].rglob("*"))
    proc = run_here(["export", str(small_run["dir"]), "--format", "specforge-eagle3", str(target)], small_run["env"])
    said = " ".join(proc.stderr.split() + proc.stdout.split())
    assert proc.returncode == 130, said
    assert "interrupted: the export was stopped and nothing of it is left" in said and "markers" not in said, said
    assert (target.is_dir() and not any(target.iterdir())) if existing else not target.exists()
    assert sorted(p.relative_to(small_run["dir"]) for p in small_run["dir"].rglob("*")) == before


def test_a_ctrl_c_whose_keyboard_interrupt_was_dropped_still_stops_the_export(small_run, tmp_path, monkeypatch):
    """CPython may raise a signal's KeyboardInterrupt inside a finalizer, which prints and drops it
    (producer/interrupts.py): the export still stops (exit 130, nothing of it left), as for a Ctrl-C
    that raised. The drop is made here by swallowing the handler's KeyboardInterrupt in a writer."""
    import signal as signals

    from producer import interrupts

    target = tmp_path / "eagle3-data"
    real_save = torch.save
    dropped = threading.Event()

    def save_then_drop_a_ctrl_c(*args, **kwargs):
        real_save(*args, **kwargs)
        if not dropped.is_set():
            dropped.set()
            try:
                interrupts._on_signal(signals.SIGINT, None)  # what main's handler does on a Ctrl-C
            except KeyboardInterrupt:
                pass  # ... and a finalizer drops what it raised

    monkeypatch.setattr(torch, "save", save_then_drop_a_ctrl_c)
    proc = run_here(["export", str(small_run["dir"]), "--format", "specforge-eagle3", str(target)], small_run["env"])
    said = " ".join(proc.stderr.split() + proc.stdout.split())
    assert dropped.is_set() and proc.returncode == 130, said
    assert "interrupted: the export was stopped" in said and not target.exists()


def test_an_export_that_meets_a_missing_shard_says_which_and_leaves_nothing(small_run, tmp_path):
    """A shard deleted after its batch was certified: ``export`` stops naming the missing shard and the
    commands that find and redo it (not "no run.json", which a new user was told with run.json in
    place), exit 1, and removes what it had written, so the same command can run again."""
    run_dir = copy_run(small_run, tmp_path)
    shards = sorted((run_dir / "shards").glob("*.safetensors"))
    assert len(shards) >= 2
    shards[-1].unlink()  # the last batch's: the earlier ones are written first
    target = tmp_path / "dflash-data"
    proc = run_here(["export", str(run_dir), "--format", "specforge-dflash", str(target)], small_run["env"])
    said = " ".join(proc.stderr.split() + proc.stdout.split())
    assert proc.returncode == 1, said
    assert f"export stopped: batch {shards[-1].name.split('-')[0]}: shard {'shards/' + shards[-1].name} is missing " \
           "from" in said, said
    assert "; nothing of the export is left" in said and "no run.json" not in said, said
    assert "producer verify" in said and "reconcile" in said and "--repair" in said, said
    assert not target.exists()
