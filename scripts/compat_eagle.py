"""Read an hsx ``eagle-ge-data`` export with EAGLE-1/2's released training code to one batch.

    python scripts/compat_eagle.py eagle-ge-data EXPORT_DIR     (in the venv scripts/compat.sh makes)

EAGLE-1/2 (eagle-llm 1.2.1 on PyPI; SafeAILab/EAGLE 79d6f79, the last commit before EAGLE-3
replaced it) has no importable data module: ``eagle/train/main.py`` is a script that parses its
arguments, loads the base model's ``lm_head`` and starts wandb at import. So this reads that file
from the installed package and executes only its data definitions, unchanged: ``list_files``,
``CustomDataset``, ``DataCollatorWithPadding`` and ``AddUniformNoise``, with the script's own
``train_config["max_len"]`` and noise ``std``. It then lists ``EXPORT_DIR/ge_data`` as the trainer
lists ``--tmpdir`` (every file under it), builds one batch with a torch ``DataLoader`` as the
trainer does, once without the noise to check the values against the files (the trainer's
targets are the next position's state and token) and once with it, and prints one ``PASS`` line.
Imports nothing from hsx.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

import torch
from torch.utils.data import DataLoader, Dataset

DEFINITIONS = ("list_files", "AddUniformNoise", "CustomDataset", "DataCollatorWithPadding")


def eagle_training_data_code() -> dict:
    """The data definitions of the installed ``eagle/train/main.py``, executed in a namespace."""
    import importlib.util

    source_path = Path(importlib.util.find_spec("eagle").origin).parent / "train" / "main.py"
    tree = ast.parse(source_path.read_text(), str(source_path))
    config = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "train_config" for t in node.targets))
    settings = {k.value: v.value for k, v in zip(config.keys, config.values)
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    kept = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in DEFINITIONS]
    assert sorted(n.name for n in kept) == sorted(DEFINITIONS), [n.name for n in kept]
    namespace = {"torch": torch, "os": os, "Dataset": Dataset, "Any": Any, "Dict": Dict, "List": List,
                 "train_config": {"max_len": settings["max_len"]}}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(source_path), "exec"), namespace)
    return {**namespace, "settings": settings, "source": str(source_path)}


def main(fmt: str, export_dir: Path) -> str:
    assert fmt == "eagle-ge-data", fmt
    info = json.loads((export_dir / "export.json").read_text())
    H = info["hidden_size"]
    eagle = eagle_training_data_code()
    files = eagle["list_files"](str(export_dir / "ge_data"))
    assert len(files) == info["samples"], f"{len(files)} files under ge_data/, export.json lists {info['samples']}"
    plain = DataLoader(eagle["CustomDataset"](files), batch_size=2, shuffle=False,
                       collate_fn=eagle["DataCollatorWithPadding"]())
    batch = next(iter(plain))
    B, L = batch["input_ids"].shape
    assert batch["hidden_states"].shape == (B, L, H) and batch["target"].shape == (B, L, H)
    for b, path in enumerate(files[:B]):
        raw = torch.load(path, weights_only=True)
        S = raw["input_ids"].shape[0]
        assert torch.equal(batch["hidden_states"][b, :S], raw["hidden_state"].to(batch["hidden_states"].dtype))
        assert torch.equal(batch["target"][b, :S - 1], raw["hidden_state"][1:].to(batch["target"].dtype))
        assert torch.equal(batch["input_ids"][b, :S - 1], raw["input_ids"][1:]), f"row {b}: next-token ids"
        assert torch.equal(batch["loss_mask"][b, :S - 1], raw["loss_mask"][:S - 1]) and batch["loss_mask"][b, S - 1] == 0
        assert int(batch["loss_mask"][b].sum()) > 0
    noisy = DataLoader(eagle["CustomDataset"](files, transform=eagle["AddUniformNoise"](std=eagle["settings"]["std"])),
                       batch_size=4, shuffle=True, collate_fn=eagle["DataCollatorWithPadding"]())
    train_batch = next(iter(noisy))
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in train_batch.items())
    return (f"PASS eagle-ge-data: {len(files)} files from list_files(ge_data/) (eagle/train/main.py, max_len "
            f"{eagle['settings']['max_len']}); CustomDataset + DataCollatorWithPadding: rows equal the files "
            f"(next-token targets); training batch with AddUniformNoise: {shapes}")


if __name__ == "__main__":
    print(main(sys.argv[1], Path(sys.argv[2])))
