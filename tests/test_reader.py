"""``hsx.reader``: the datasets users' training code reads a run with return exactly what the
shards hold, per sample, with the documented names, shapes and dtypes."""

from __future__ import annotations

import pickle

import pytest
import torch

from jobfixtures import read_samples
from smallrun import copy_run, quarantine_first_sample, upload_run

from hsx.errors import BadConfig, FidelityError
from hsx.reader import HiddenStatesDataset, IterableHiddenStatesDataset
from hsx.runconfig import load_run
from hsx.store import open_store

K, H = 3, 64  # EAGLE-3 layers of the 8-layer tiny model, hidden size 64


def _assert_equals_shard(item: dict, ref: dict) -> None:
    S = ref["input_ids"].shape[0]
    assert item["input_ids"].dtype == torch.int64 and item["input_ids"].shape == (S,)
    assert item["loss_mask"].dtype == torch.int64 and item["loss_mask"].shape == (S,)
    assert item["hidden_states"].dtype == torch.bfloat16 and item["hidden_states"].shape == (S, K * H)
    assert torch.equal(item["input_ids"], ref["input_ids"].to(torch.int64))
    assert torch.equal(item["loss_mask"], ref["loss_mask"].to(torch.int64))
    # Layer k occupies columns k*H:(k+1)*H, in ascending layer id.
    assert torch.equal(item["hidden_states"].view(S, K, H), ref["hidden_states"])
    for name in ("final_postnorm", "final_prenorm"):
        if name in item:
            assert item[name].shape == (S, H) and torch.equal(item[name], ref[name])


def test_map_style_dataset_returns_every_sample_in_sample_index_order_equal_to_the_shards(small_run):
    """ds[i] is the i-th sample by sample_index; each equals the shard rows read_samples() returns."""
    ds = HiddenStatesDataset(small_run["address"])
    ref = read_samples(open_store(small_run["address"]))
    assert len(ds) == len(ref) == small_run["report"]["plan"]["samples"]
    assert ds.sample_indices.tolist() == sorted(ref)
    for i in range(len(ds)):
        item = ds[i]
        assert item["sample_index"] == ds.sample_indices[i]
        assert set(item) == {"sample_index", "input_ids", "loss_mask", "hidden_states", "final_postnorm", "final_prenorm"}
        _assert_equals_shard(item, ref[item["sample_index"]])
    assert ds.position_of(int(ds.sample_indices[-1])) == len(ds) - 1
    assert ds[-1]["sample_index"] == ds.sample_indices[-1]
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_map_style_dataset_selects_finals_pickles_and_feeds_a_dataloader(small_run):
    """finals='postnorm' returns only that final; a used dataset pickles without open handles; DataLoader batches it."""
    ds = HiddenStatesDataset(small_run["address"], finals="postnorm")
    first = ds[0]
    assert "final_postnorm" in first and "final_prenorm" not in first
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[0]["hidden_states"], first["hidden_states"])
    loader = torch.utils.data.DataLoader(ds, batch_size=1, shuffle=True)
    assert sum(1 for _ in loader) == len(ds)
    with pytest.raises(BadConfig):
        HiddenStatesDataset(small_run["address"], finals="sideways")


def test_quarantined_samples_are_not_returned(small_run, tmp_path):
    """A sample a marker lists as quarantined is absent from both datasets."""
    run_dir = copy_run(small_run, tmp_path)
    sample = quarantine_first_sample(run_dir, "b000000")
    ds = HiddenStatesDataset(str(run_dir))
    assert sample not in ds.sample_indices.tolist()
    assert len(ds) == small_run["report"]["plan"]["samples"] - 1
    assert sample not in [s["sample_index"] for s in IterableHiddenStatesDataset(str(run_dir))]


def test_a_sample_certified_twice_is_refused_by_the_map_style_dataset(small_run, tmp_path):
    """Two markers certifying the same samples (a corrupt run): refused, naming both batches."""
    run_dir = copy_run(small_run, tmp_path)
    marker = (run_dir / "markers" / "b000001.json").read_text()
    (run_dir / "markers" / "b000009.json").write_text(marker.replace('"batch": "b000001"', '"batch": "b000009"'))
    with pytest.raises(FidelityError, match="b000001 and b000009"):
        HiddenStatesDataset(str(run_dir))


def test_the_map_style_dataset_with_verify_refuses_a_shard_altered_after_its_marker(small_run, tmp_path):
    """``verify=True`` hashes every shard against its marker before any sample is read: an altered
    byte is refused naming its batch; an untouched run reads as without it (by default the shards
    are memory-mapped as they are)."""
    run_dir = copy_run(small_run, tmp_path)
    assert len(HiddenStatesDataset(str(run_dir), verify=True)) == len(HiddenStatesDataset(str(run_dir)))
    shard = sorted((run_dir / "shards").glob("b000001-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # a byte of the last sample's states
    shard.write_bytes(bytes(data))
    with pytest.raises(FidelityError, match=r"batch b000001: shard .* sha256"):
        HiddenStatesDataset(str(run_dir), verify=True)
    assert len(HiddenStatesDataset(str(run_dir))) == small_run["report"]["plan"]["samples"]


@pytest.mark.parametrize("reader", [HiddenStatesDataset, IterableHiddenStatesDataset])
def test_a_missing_shard_is_a_fidelity_error_naming_its_batch_and_verify_in_every_reader(reader, small_run, tmp_path):
    """A shard deleted after its marker: both readers say which batch and shard, and what to run
    (the iterable one raised a bare FileNotFoundError)."""
    run_dir = copy_run(small_run, tmp_path)
    (shard,) = (run_dir / "shards").glob("b000001-*.safetensors")
    shard.unlink()
    with pytest.raises(FidelityError, match=rf"batch b000001: shard shards/{shard.name} is missing from .*"
                                            r"python -m producer verify"):
        list(reader(str(run_dir)))


def test_iterable_dataset_streams_the_same_samples_and_splits_shards_between_ranks(small_run):
    """Shard by shard, every stored sample once, equal to the shards; ranks get disjoint shards covering the run."""
    ref = read_samples(open_store(small_run["address"]))
    seen = {}
    for item in IterableHiddenStatesDataset(small_run["address"]):
        assert item["sample_index"] not in seen
        seen[item["sample_index"]] = item
        _assert_equals_shard(item, ref[item["sample_index"]])
    assert seen.keys() == ref.keys()
    parts = [IterableHiddenStatesDataset(small_run["address"], rank=r, world_size=2, shuffle_shards=True, seed=3) for r in range(2)]
    batches = [p.batches() for p in parts]
    assert not set(batches[0]) & set(batches[1]) and sorted(batches[0] + batches[1]) == sorted(parts[0].markers)


def test_iterable_dataset_reads_a_run_on_s3_and_refuses_an_altered_shard(small_run, s3_bucket, tmp_path):
    """From S3 one shard at a time through a temp file: same samples; a shard whose bytes differ from
    its marker is refused before any sample of it is returned."""
    store = open_store(s3_bucket.url, s3_bucket.settings).child(small_run["report"]["run_id"])
    upload_run(small_run["dir"], store)
    ref = read_samples(open_store(small_run["address"]))
    ds = IterableHiddenStatesDataset(store, finals="prenorm", tmp_dir=tmp_path)
    got = {s["sample_index"]: s for s in ds}
    assert got.keys() == ref.keys()
    for sample, item in got.items():
        assert "final_postnorm" not in item
        _assert_equals_shard(item, ref[sample])
    assert list(tmp_path.iterdir()) == [], "downloaded shards must be deleted"
    with pytest.raises(BadConfig, match="not a local directory"):
        HiddenStatesDataset(store)
    key = ds.markers["b000000"].shard.key
    data = bytearray(store.read(key))
    data[-1] ^= 1
    store.write(key, bytes(data))
    with pytest.raises(FidelityError, match="sha256"):
        list(ds.iter_batch("b000000"))
    assert load_run(store).run_id == small_run["report"]["run_id"]
