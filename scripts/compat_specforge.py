"""Read an hsx SpecForge export with SpecForge's released code to one training batch.

    python scripts/compat_specforge.py FORMAT EXPORT_DIR     (in the venv scripts/compat.sh makes)

FORMAT is specforge-eagle3, specforge-dflash or specforge-dspark. This composes the offline data
path the way SpecForge 0.2.0's ``specforge/launch.py`` does for ``specforge train`` (read at
sgl-project/SpecForge a6b6b02, the same files as the 0.2.0 wheel): the algorithm's registered
offline provider builds the reader (``OfflineManifestReader``), the per-sample normaliser and the
collator; ``FeatureDataLoader`` over a ``LocalFeatureStore`` loads the files and makes the batch.
Then it checks the batch against the files (read with ``torch.load(weights_only=True)``) and the
export's ``export.json`` (hidden size, layer count, sample count), and prints one ``PASS`` line.
Runs with SpecForge's packages only: it imports nothing from hsx.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

BATCH_SIZE = 2
MAX_LEN = 4096


def registration(fmt: str):
    if fmt == "specforge-eagle3":
        from specforge.algorithms.eagle3 import create_registration
    elif fmt == "specforge-dflash":
        from specforge.algorithms.dflash import create_registration
    elif fmt == "specforge-dspark":
        from specforge.algorithms.dspark import create_registration
    else:
        raise SystemExit(f"unknown format {fmt!r}")
    return create_registration()


def main(fmt: str, export_dir: Path) -> str:
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    info = json.loads((export_dir / "export.json").read_text())
    H, K = info["hidden_size"], len(info["layer_ids"])
    algorithm = registration(fmt)
    provider = algorithm.providers.offline_for("text")
    refs = provider.build_reader(str(export_dir), run_id="hsx-compat", ttt_length=7, max_len=MAX_LEN).read()
    assert len(refs) == info["samples"], f"the reader found {len(refs)} files, export.json lists {info['samples']}"
    normalise = provider.build_normalizer(MAX_LEN, ttt_length=7, use_usp_preprocess=False)
    loader = FeatureDataLoader(LocalFeatureStore("hsx-compat"), refs=refs, batch_size=BATCH_SIZE,
                               collate_fn=provider.build_collator(), per_sample_transform=normalise,
                               drop_last=False, strategy=algorithm.name)
    batch = next(iter(loader))
    t = batch.tensors
    raws = [torch.load(ref.feature_store_uri[len("file://"):], weights_only=True) for ref in refs[:BATCH_SIZE]]
    B, L = t["input_ids"].shape
    assert B == BATCH_SIZE and L == max(r["input_ids"].shape[0] for r in raws)
    for b, raw in enumerate(raws):
        S = raw["input_ids"].shape[0]
        assert torch.equal(t["input_ids"][b, :S], raw["input_ids"]), f"row {b}: input_ids"
        if fmt == "specforge-eagle3":
            assert t["hidden_state"].shape == (B, L, 3 * H) and t["target"].shape == (B, L, H)
            assert torch.equal(t["hidden_state"][b, :S], raw["aux_hidden_state"][0]), f"row {b}: aux layers"
            assert torch.equal(t["target"][b, :S], raw["hidden_state"][0]), f"row {b}: target (final post-norm)"
            # The normaliser zeroes the last position's mask itself; the rest is ours.
            assert torch.equal(t["loss_mask"][b, :S - 1], raw["loss_mask"][:S - 1]) and t["loss_mask"][b, S - 1] == 0
        else:
            assert t["hidden_states"].shape == (B, L, K * H), f"hidden_states {tuple(t['hidden_states'].shape)}"
            assert torch.equal(t["hidden_states"][b, :S], raw["hidden_states"][0]), f"row {b}: target layers"
            assert torch.equal(t["loss_mask"][b, :S], raw["loss_mask"]), f"row {b}: loss_mask"
            if fmt == "specforge-dspark":
                assert t["target_last_hidden_states"].shape == (B, L, H)
                assert torch.equal(t["target_last_hidden_states"][b, :S], raw["target_last_hidden_states"][0])
        assert int(t["loss_mask"][b].sum()) > 0, f"row {b}: nothing supervised"
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).removeprefix('torch.')}" for k, v in t.items())
    vocab = ""
    if fmt == "specforge-eagle3":
        # SpecForge builds the EAGLE-3 draft vocabulary from the feature files themselves
        # (specforge/training/vocab_mapping.py); it must count what vocab_counts.safetensors counts.
        from safetensors.torch import load_file
        from specforge.training.vocab_mapping import count_effective_feature_tokens

        theirs = count_effective_feature_tokens(str(export_dir), max_length=MAX_LEN)
        ours = load_file(str(export_dir / "vocab_counts.safetensors"))["counts"]
        nonzero = {int(v): int(ours[v]) for v in torch.nonzero(ours).flatten().tolist()}
        assert dict(theirs) == nonzero, "count_effective_feature_tokens differs from vocab_counts.safetensors"
        vocab = f"; count_effective_feature_tokens = vocab_counts.safetensors ({len(nonzero)} token ids)"
    return (f"PASS {fmt}: {len(refs)} files listed by OfflineManifestReader (strategy {algorithm.name}); "
            f"one batch from FeatureDataLoader + {algorithm.name} normaliser + collator: {shapes}; "
            f"rows equal the files (K={K}, H={H}){vocab}")


if __name__ == "__main__":
    print(main(sys.argv[1], Path(sys.argv[2])))
