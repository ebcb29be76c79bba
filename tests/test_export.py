"""``python -m producer export``: each format loads back with the tensor names, shapes and dtypes
its trainer reads (producer/export.py says where each was matched), with the values the shards
hold; ``vocab_counts.safetensors`` counts exactly the supervised tokens."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file as load_numpy
from safetensors.torch import load_file

from jobfixtures import cli_json, read_samples, run_cli
from smallrun import copy_run, small_run  # noqa: F401

from core.errors import BadConfig
from core.runconfig import load_run
from core.store import open_store
from producer.export import check_exportable, export_run, supervised_token_counts

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
    report = cli_json(run_cli("producer", ["export", small_run["address"], "--format", "specforge-eagle3", str(out), "--json"],
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
    assert json.loads((out / "state.json").read_text())["_data_files"] == [{"filename": "data-00000-of-00001.arrow"}]
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
    """When `datasets` is installed, load_from_disk reads the table as speculators does."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "speculators"
    export_run(open_store(small_run["address"]), "speculators", out)
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["input_ids", "loss_mask", "seq_len"] and len(ds) == len(_index(out))


def test_vocab_counts_subcommand_writes_the_runs_counts(small_run, stored, tmp_path):
    """`vocab-counts --output FILE`: counts of input ids at loss_mask == 1 over every stored sample."""
    target = tmp_path / "counts.safetensors"
    info = cli_json(run_cli("producer", ["vocab-counts", small_run["address"], "--output", str(target), "--json"], small_run["env"]))
    assert info["supervised_tokens"] == _supervised(stored) and info["samples"] == len(stored)
    _check_vocab_counts(target, stored)


def test_formats_refuse_runs_without_what_their_trainer_needs(small_run, tmp_path):
    """EAGLE-3 needs exactly 3 layers and the post-norm final; speculators the pre-norm final; the CLI exits 2 with the fix."""
    config = load_run(open_store(small_run["address"]))

    def variant(**layers):
        return dataclasses.replace(config, layers={**config.layers, **layers})

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
    proc = run_cli("producer", ["export", str(run_dir), "--format", "speculators", str(tmp_path / "x")], small_run["env"])
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
