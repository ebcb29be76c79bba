"""Read an hsx ``modelopt`` export with NVIDIA ModelOpt's released code to one training batch.

    python scripts/compat_modelopt.py modelopt EXPORT_DIR     (in the venv scripts/compat.sh makes)

ModelOpt 0.47.0: offline training (``data.offline_data_path`` in its speculative-decoding
example, ``examples/speculative_decoding/eagle_utils.py`` at NVIDIA/Model-Optimizer a2fbac7) lists
every ``*.pt`` under the path (``rglob``) into ``OfflineSupervisedDataset`` and batches with
``EagleOfflineDataCollator`` (both in the package, ``modelopt/torch/speculative/eagle/utils.py``).
This does the same with ``answer_only_loss=True`` (the stored ``loss_mask``), checks each sample
against its file, makes one batch with a torch ``DataLoader`` and prints one ``PASS`` line.
Imports nothing from hsx.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

TRAIN_LEN = 1024


def main(fmt: str, export_dir: Path) -> str:
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    assert fmt == "modelopt", fmt
    info = json.loads((export_dir / "export.json").read_text())
    H, K = info["hidden_size"], len(info["layer_ids"])
    files = [str(p) for p in export_dir.rglob("*.pt")]
    assert len(files) == info["samples"], f"{len(files)} .pt files, export.json lists {info['samples']}"
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    for i, path in enumerate(files):
        item, raw = dataset[i], torch.load(path, weights_only=True)
        S = raw["input_ids"].shape[0]
        assert item["base_model_hidden_states"].shape == (S, H) and item["aux_hidden_states"].shape == (S, K * H)
        assert torch.equal(item["loss_mask"], raw["loss_mask"]) and int(item["loss_mask"].sum()) > 0
        assert torch.equal(item["labels"][:-1], raw["input_ids"][1:]) and item["base_hidden_prenorm"] is False
        assert isinstance(raw["conversation_id"], str)
    loader = DataLoader(dataset, batch_size=2, shuffle=True, collate_fn=EagleOfflineDataCollator(train_len=TRAIN_LEN))
    batch = next(iter(loader))
    outputs = batch["base_model_outputs"]
    assert batch["input_ids"].shape == (2, TRAIN_LEN) and outputs["aux_hidden_states"].shape == (2, TRAIN_LEN, K * H)
    assert outputs["base_model_hidden_states"].shape == (2, TRAIN_LEN, H) and outputs["base_hidden_prenorm"] is False
    tensors = {**{k: v for k, v in batch.items() if isinstance(v, torch.Tensor)},
               **{k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)}}
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in tensors.items())
    return (f"PASS modelopt: {len(files)} .pt files into OfflineSupervisedDataset(answer_only_loss=True), every "
            f"sample equals its file; EagleOfflineDataCollator(train_len={TRAIN_LEN}) batch: {shapes}")


if __name__ == "__main__":
    print(main(sys.argv[1], Path(sys.argv[2])))
