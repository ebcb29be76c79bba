"""Read an hsx ``speculators`` export with speculators' released code to one training batch.

    python scripts/compat_speculators.py speculators EXPORT_DIR     (in the venv scripts/compat.sh makes)

speculators 0.9.0 (read in the wheel; the same checks at vllm-project/speculators c05b95b):
``speculators train`` builds its loaders with ``create_train_val_loaders``
(``speculators/train/dataloader.py``): ``ArrowDataset`` (``load_from_disk`` of the table, then
``FileTransfer.get_cached`` reads ``hidden_states/hs_{i}.safetensors``, and the sample is dropped
unless ``torch.equal(token_ids, data[i]["input_ids"])``), the multipack batch sampler and
``CollateFn``, with ``shift_batch`` as the per-sample preprocess for EAGLE-3 and none for DFlash
(``speculators/train/cli.py``). This runs that function for both drafts with ``on_missing="raise"``
(no vLLM server), takes one training batch, checks that no sample was dropped, that every sample
of the dataset equals its files, and that the first packed document of the DFlash batch is one of
them; then builds the draft vocabulary from ``token_freq.pt`` with
``build_vocab_mappings_from_distribution``. Prints one ``PASS`` line. Imports nothing from hsx.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

TOTAL_SEQ_LEN = 2048


def loaders(export_dir: Path, H: int, K: int, preprocess):
    from speculators.train.dataloader import create_train_val_loaders

    return create_train_val_loaders(
        data_path=str(export_dir), total_seq_len=TOTAL_SEQ_LEN, hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1", on_missing="raise", verifier_name_or_path="hsx-compat",
        request_timeout=1.0, max_retries=0, generation_validation_retries=0, max_consecutive_generation_failures=1,
        hidden_size=H, num_target_layers=K, num_workers=0, prefetch_factor=2, preprocess=preprocess,
        train_data_ratio=0.9)


def main(fmt: str, export_dir: Path) -> str:
    from safetensors.torch import load_file
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    assert fmt == "speculators", fmt
    info = json.loads((export_dir / "export.json").read_text())
    H, K = info["hidden_size"], len(info["layer_ids"])
    lines = []
    for draft, preprocess in (("eagle3", shift_batch), ("dflash", None)):
        train, val = loaders(export_dir, H, K, preprocess)
        dataset = train.dataset
        assert len(dataset) + len(val.dataset) == info["samples"]
        items = [dataset[i] for i in range(len(dataset))]
        for i, item in enumerate(items):
            assert isinstance(item, dict), f"ArrowDataset dropped sample {i}: {item!r}"
            hs = load_file(str(export_dir / "hidden_states" / f"hs_{i}.safetensors"))
            assert torch.equal(item["hidden_states"], hs["hidden_states"][:, :-1].flatten(1))
            assert torch.equal(item["verifier_last_hidden_states"], hs["hidden_states"][:, -1])
            assert item["hidden_states"].shape[1] == K * H
        batch = next(iter(train))
        assert batch["error_records"] == 0, f"{batch['error_records']} samples dropped from the batch"
        T = TOTAL_SEQ_LEN
        assert batch["hidden_states"].shape == (1, T, K * H) and batch["verifier_last_hidden_states"].shape == (1, T, H)
        assert batch["input_ids"].shape == (1, T) and batch["loss_mask"].shape == (1, T)
        docs = batch["document_ids"][0]
        lengths = torch.bincount(docs[docs >= 0]).tolist()  # tokens of each packed sample, in order
        if preprocess is None:
            n = lengths[0]
            first = [it for it in items if torch.equal(it["input_ids"][:n], batch["input_ids"][0, :n])]
            assert first and torch.equal(batch["hidden_states"][0, :n], first[0]["hidden_states"][:n])
            assert torch.equal(batch["loss_mask"][0, :n], first[0]["loss_mask"][:n].to(batch["loss_mask"].dtype))
        shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                           for k, v in batch.items() if isinstance(v, torch.Tensor))
        lines.append(f"{draft}: {len(items)} train samples load (none dropped); batch of {len(lengths)} packed samples "
                     f"({sum(lengths)} tokens): {shapes}")
    freq = torch.load(export_dir / "token_freq.pt", weights_only=True)
    d2t, t2d = build_vocab_mappings_from_distribution(freq, draft_vocab_size=32, target_vocab_size=151_936)
    assert d2t.shape == (32,) and int(t2d.sum()) == 32
    return (f"PASS speculators: create_train_val_loaders(on_missing='raise') for "
            + "; ".join(lines) + f"; token_freq.pt: {len(freq)} token ids -> d2t {list(d2t.shape)}, t2d {list(t2d.shape)}")


if __name__ == "__main__":
    print(main(sys.argv[1], Path(sys.argv[2])))
