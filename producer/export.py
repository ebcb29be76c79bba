"""``python -m producer export RUN_ADDRESS --format F OUT``: write a run as the files trainers read.

Legend: S = tokens of one sample, K = captured layers, H = hidden size, V = vocabulary size.

Samples are numbered ``i = 0, 1, ...`` in export order: batches by name, then rows within each
shard (quarantined samples left out). ``OUT/export.json`` maps every ``i`` to its ``sample_index``
(its line in the run's ``plan/samples.jsonl``) and records the layer ids in both conventions.
Every shard is hashed against its marker before it is read. The run must be complete (every
planned batch has its marker) unless ``partial=True``. Hidden states are written in bf16, what
every format below is produced in upstream; an fp8 run (``--store-dtype fp8``) is dequantised by the
reader (``q * scale`` per token and layer, ``hsx/fp8.py``) before it is written, so no export file
ever holds fp8 (``export.json`` records the run's ``store_dtype``).

Formats, and what each was matched against. Each was read in the consumer's released package from
PyPI, and ``scripts/compat.sh`` loads every export through that package's own dataset and collator
code to one training batch (README, "Trainer compatibility"):

``specforge-eagle3`` (SpecForge 0.2.0 = sgl-project/SpecForge a6b6b02: ``OfflineManifestReader`` in
``specforge/runtime/data_plane/offline_reader.py``, ``normalize_offline_sample`` in
``specforge/algorithms/eagle3/data.py``, ``DataCollatorWithPadding`` in ``specforge/data/utils.py``;
the writer is ``scripts/prepare_hidden_states.py``)
    ``OUT/rows_{g}-{g+G}/data_{i}.ckpt`` with ``g = i // G * G`` (``G`` = ``--group-size``,
    upstream ``--file-group-size`` default 2000), each a ``torch.save`` of ``{"input_ids": int64
    [S], "loss_mask": int64 [S], "hidden_state": bf16 [1, S, H], "aux_hidden_state": bf16
    [1, S, 3H]}``. The reader walks every ``.ckpt`` / ``.ckpt.gz`` under ``OUT`` (sorted paths),
    so the folders are only for the file system. ``hidden_state`` is the final state AFTER the
    norm (sglang's logits-processor input; the normaliser calls it ``target``);
    ``aux_hidden_state`` is the 3 EAGLE layers concatenated in id order (upstream default ids
    ``[1, N//2 - 1, N - 4]`` in the output-of convention). The normaliser slices ``[:max_len]``
    and sets ``loss_mask[-1] = 0`` itself. Refused unless the run has exactly 3 layers and the
    post-norm final state.
``specforge-dflash`` (SpecForge 0.2.0: ``normalize_offline_sample`` and the collator in
``specforge/algorithms/common/dflash_family_data.py``, strategies ``dflash`` and ``domino``)
    The same folders and file names, each ``{"input_ids": int64 [S], "loss_mask": int64 [S],
    "hidden_states": bf16 [1, S, K*H]}`` with the K layers in ascending id (``target_layer_ids``)
    order; the normaliser accepts [S, K*H] or [1, S, K*H] and refuses a sample without two
    consecutive supervised tokens (the planner never plans one).
``specforge-dspark`` (SpecForge 0.2.0: ``normalize_dspark_offline_sample`` in the same file,
strategy ``dspark``)
    The DFlash keys plus ``"target_last_hidden_states": bf16 [1, S, H]``, the final state AFTER
    the norm (SpecForge's ``target_repr="hidden_state"``), row ``t`` aligned to ``input_ids[t]``
    (the trainer gathers row ``t - 1`` to predict token ``t``). Refused without the post-norm
    final state.
``speculators`` (speculators 0.9.0: ``ArrowDataset`` and ``CollateFn`` in
``speculators/train/data.py``, ``create_train_val_loaders`` in ``speculators/train/dataloader.py``,
``FileTransfer.get_cached`` in hs-connectors 0.9.0 ``hs_connectors/transfer.py``; the same checks
at vllm-project/speculators c05b95b)
    ``OUT/`` is a Hugging Face ``datasets`` ``save_to_disk`` directory (``data-00000-of-00001.arrow``
    in Arrow stream format, ``dataset_info.json``, ``state.json``; written with pyarrow) with
    columns ``input_ids`` list<int64>, ``loss_mask`` list<int64>, ``seq_len`` int64, row ``i`` =
    sample ``i``. ``state.json`` records ``"_format_type": "torch"``, what
    ``Dataset.set_format("torch")`` followed by ``save_to_disk`` writes (speculators'
    ``data_generation/preprocessing.py`` does exactly that): ``ArrowDataset`` compares
    ``torch.equal(token_ids, data[i]["input_ids"])``, which needs rows to load as tensors.
    ``OUT/hidden_states/hs_{i}.safetensors`` holds ``hidden_states`` bf16 [S, K+1, H] (the K
    layers in ascending id, i.e. vLLM ids ``id + 1``, then the final state BEFORE the norm, vLLM
    id ``N``: the dataset splits it into ``hidden_states`` [S, K*H] and
    ``verifier_last_hidden_states`` [S, H]) and ``token_ids`` int64 [S]; ``OUT/token_freq.pt`` is
    a ``torch.save`` of ``{token_id: count}`` (what ``speculators train`` loads for the draft
    vocabulary). EAGLE-3 and DFlash drafts read the same files. Refused without the pre-norm
    final state.
``eagle-ge-data`` (EAGLE-1/2, eagle-llm 1.2.1 = SafeAILab/EAGLE 79d6f79, the last commit before
EAGLE-3 replaced it: ``list_files``, ``CustomDataset`` and ``DataCollatorWithPadding`` in
``eagle/train/main.py``; the writer is ``eagle/ge_data/ge_data_all_vicuna.py``)
    ``OUT/ge_data/rows_{g}-{g+G}/data_{i}.ckpt``, each ``{"input_ids": int64 [S], "hidden_state":
    bf16 [S, H], "loss_mask": int64 [S]}`` with no batch axis; ``hidden_state`` is the final state
    AFTER the norm (upstream stores HF ``hidden_states[-1]``, in the model's dtype: fp16 there;
    bf16 here, which the trainer's collator promotes with its fp32 padding). The trainer loads
    EVERY file under ``--tmpdir`` (``os.walk``), so ``OUT/ge_data`` holds nothing else: pass
    ``--tmpdir OUT/ge_data``. Only the final state is written (EAGLE-1/2 read no other layer).
    Refused without the post-norm final state.
``modelopt`` (NVIDIA ModelOpt 0.47.0: ``OfflineSupervisedDataset`` and ``EagleOfflineDataCollator``
in ``modelopt/torch/speculative/eagle/utils.py``; the writer is
``examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py`` at
NVIDIA/Model-Optimizer a2fbac7)
    ``OUT/{conversation_id}.pt`` per sample, each ``{"input_ids": int64 [S], "hidden_states": bf16
    [S, H], "aux_hidden_states": bf16 [S, K*H], "loss_mask": int64 [S], "conversation_id": str}``.
    ``hidden_states`` is the final state AFTER the norm (HF ``hidden_states[-1]``; the dataset's
    ``base_hidden_prenorm`` flag stays False); ``aux_hidden_states`` the K layers in id order
    (upstream reads HF ``hidden_states[lid + 1]`` for 0-based ids, our convention; its EAGLE
    default ``[1, N//2 - 1, N - 4]`` is our ``--preset eagle3``). ``conversation_id`` is the
    record id (``plan/samples.jsonl``); the file name is that id with every character outside
    ``[A-Za-z0-9_.-]`` (and a leading ``.``) written as ``%XX``. The reader (ModelOpt >= 0.44)
    takes every ``*.pt`` under ``data.offline_data_path``, and uses the stored ``loss_mask``
    only with ``training.answer_only_loss=true`` (else every token is supervised). ModelOpt
    before 0.44 (NVIDIA/TensorRT-Model-Optimizer 5a4242f) also needed the conversations JSONL,
    which it tokenised again; that layout is not written. Refused without the post-norm final
    state.

Every format also gets ``OUT/vocab_counts.safetensors`` (:func:`supervised_token_counts`).
``torch.save`` files are pickles: written only here, in this explicit export step; the project
itself never loads one.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from hsx.errors import BadConfig, FidelityError
from hsx.layers import eagle3_layer_ids
from hsx.plan import read_batch, read_batch_list
from hsx.reader import IterableHiddenStatesDataset, certified_markers, quarantined_ids
from hsx.records import SampleRow
from hsx.regen import refuse_regenerate_run
from hsx.runconfig import RunConfig, load_run
from hsx.shard import FINAL_POSTNORM, FINAL_PRENORM, Final
from hsx.store import Store
from producer import interrupts
from producer.words import fmt_bytes

FORMATS = ("specforge-eagle3", "specforge-dflash", "specforge-dspark", "speculators", "eagle-ge-data", "modelopt")
#: the final state each format writes (what the reader is asked for).
FORMAT_FINAL = {"specforge-eagle3": Final.POSTNORM, "specforge-dflash": Final.NONE, "specforge-dspark": Final.POSTNORM,
                "speculators": Final.PRENORM, "eagle-ge-data": Final.POSTNORM, "modelopt": Final.POSTNORM}
#: how each format's report describes that final state.
FORMAT_FINAL_TEXT = {"specforge-eagle3": "postnorm (hidden_state)", "specforge-dflash": "none",
                     "specforge-dspark": "postnorm (target_last_hidden_states)",
                     "speculators": "prenorm (last of hidden_states' L axis)",
                     "eagle-ge-data": "postnorm (hidden_state)", "modelopt": "postnorm (hidden_states)"}
#: the folder of an ``eagle-ge-data`` export that holds the data files, and nothing else.
GE_DATA_DIR = "ge_data"
#: samples per ``rows_{g}-{g+G}`` folder (SpecForge ``--file-group-size`` default).
GROUP_SIZE = 2000
#: parallel file writes, and how many may be queued before the reader waits.
IO_THREADS = 4
IO_QUEUE = 16
VOCAB_COUNTS = "vocab_counts.safetensors"
VOCAB_COUNTS_DEFINITION = (
    "counts[v] = number of positions with loss_mask == 1 whose input id is v, over every stored sample "
    "(quarantined samples excluded); the same tokens SpecForge generate_vocab_mapping_file and speculators "
    "save_token_frequency_distribution count (input_ids[loss_mask == 1])"
)
ARROW_FILE = "data-00000-of-00001.arrow"


# --- supervised-token counts ----------------------------------------------------------------


def supervised_token_counts(run_store: Store, config: RunConfig | None = None, *, partial: bool = True,
                            progress=None) -> tuple[np.ndarray, dict]:
    """Counts of supervised target token ids over the run: int64 [V] and a summary.

    ``counts[v]`` is the number of tokens with ``loss_mask == 1`` whose id is ``v``, over the
    samples of every certified batch minus its quarantined samples (the samples the reader and
    the exports return). They are counted from the plan's batches, which hold exactly the ids
    and masks of the shards (``verify`` checks that echo), so no hidden states are downloaded.
    ``V`` is the tokenizer's vocabulary size from run.json, or more if an id is larger.
    Counting the input ids at supervised positions is what SpecForge and speculators count for
    their draft vocabularies (d2t / t2d).

    Raises:
        BadConfig: ``partial`` is False and some planned batch has no certified marker.
    """
    config = config or load_run(run_store)
    refuse_regenerate_run(config, run_store.url)
    markers = certified_markers(run_store, config)
    planned = [b.batch for b in read_batch_list(run_store)]
    missing = [b for b in planned if b not in markers]
    if missing and not partial:
        raise BadConfig(f"run {config.run_id}: {len(missing)} of {len(planned)} batches have no marker (first {missing[0]}); "
                        "finish the run, or pass --partial to use the batches that are done")
    V = config.tokenizer.vocab_size
    counts = np.zeros(max(V, 1), dtype=np.int64)
    samples = supervised = 0
    task = progress.add_task("counting", total=len(markers)) if progress is not None else None
    for batch in sorted(markers):
        plan = read_batch(run_store, batch)
        skip = quarantined_ids(markers[batch])
        keep_T = plan.loss_mask_T.astype(bool)
        if skip:
            keep_N = np.array([s not in skip for s in plan.sample_index_N.tolist()], dtype=bool)
            keep_T &= np.repeat(keep_N, np.diff(plan.cu_seqlens_N1))
        ids = plan.input_ids_T[keep_T].astype(np.int64)
        if ids.size and ids.max() >= counts.shape[0]:
            counts = np.concatenate([counts, np.zeros(int(ids.max()) + 1 - counts.shape[0], dtype=np.int64)])
        counts += np.bincount(ids, minlength=counts.shape[0])
        samples += plan.num_samples - len(skip & set(plan.sample_index_N.tolist()))
        supervised += int(ids.size)
        if task is not None:
            progress.update(task, advance=1)
    info = {"run_id": config.run_id, "vocab_size": int(counts.shape[0]), "samples": samples,
            "supervised_tokens": supervised, "distinct_tokens": int(np.count_nonzero(counts)),
            "batches": len(markers), "batches_missing": len(missing), "definition": VOCAB_COUNTS_DEFINITION}
    return counts, info


def vocab_counts_bytes(counts: np.ndarray, info: dict) -> bytes:
    """``vocab_counts.safetensors``: tensor ``counts`` int64 [V]; metadata: the summary (strings)."""
    from safetensors.numpy import save

    return save({"counts": counts.astype(np.int64)}, metadata={k: str(v) for k, v in info.items()})


# --- format checks --------------------------------------------------------------------------


def check_exportable(config: RunConfig, fmt: str) -> list[str]:
    """Refuse (BadConfig) a run that lacks what ``fmt`` needs; return warnings for the rest."""
    if fmt not in FORMATS:
        raise BadConfig(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    layers = config.layers
    ids, final, N = list(layers.layer_ids), layers.final, layers.num_layers
    warnings = []
    if fmt == "specforge-eagle3":
        if len(ids) != 3:
            raise BadConfig(
                f"run {config.run_id} captured {len(ids)} layers {ids}; SpecForge EAGLE-3 needs exactly the 3 EAGLE layers "
                f"(aux_hidden_state [1, S, 3H]). Extract with --preset eagle3 (ids {eagle3_layer_ids(N)} for {N} layers)"
            )
        if not final.has_postnorm:
            raise BadConfig(
                f"run {config.run_id} stored final={final.value!r}; SpecForge EAGLE-3 needs the final state AFTER the norm "
                "(hidden_state [1, S, H]). Extract with --final postnorm (or both)"
            )
        if ids != eagle3_layer_ids(N):
            warnings.append(f"layer ids {ids} are not SpecForge's EAGLE-3 default {eagle3_layer_ids(N)}: "
                            "configure the draft's aux layers to match")
    if fmt == "speculators" and not final.has_prenorm:
        raise BadConfig(
            f"run {config.run_id} stored final={final.value!r}; speculators needs the final state BEFORE the norm as the last "
            "layer of hidden_states (it applies the norm itself). Extract with --final prenorm (or both)"
        )
    needs_postnorm = {"specforge-dspark": "SpecForge DSpark needs the final state AFTER the norm (target_last_hidden_states [1, S, H])",
                      "eagle-ge-data": "EAGLE-1/2 (ge_data) needs the final state AFTER the norm (hidden_state [S, H])",
                      "modelopt": "ModelOpt needs the final state AFTER the norm (hidden_states [S, H])"}
    if fmt in needs_postnorm and not final.has_postnorm:
        raise BadConfig(f"run {config.run_id} stored final={final.value!r}; {needs_postnorm[fmt]}. Extract with --final postnorm (or both)")
    if fmt == "eagle-ge-data":
        warnings.append(f"EAGLE-1/2 reads the final state only: the {len(ids)} captured layers {ids} are not written")
    if fmt == "modelopt" and ids != eagle3_layer_ids(N):
        warnings.append(f"layer ids {ids} are not ModelOpt's EAGLE default {eagle3_layer_ids(N)} (--aux-layers eagle): "
                        "set the draft's aux layer ids to match")
    return warnings


# --- writers --------------------------------------------------------------------------------


def _atomic(path: Path, write) -> int:
    """Write ``path`` through a temp name + rename (never a partial file at ``path``); returns bytes."""
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex[:8]}-{path.name}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size


class _SpecForgeWriter:
    """``rows_{g}-{g+G}/data_{i}.ckpt`` per sample, EAGLE-3 / DFlash / DSpark keys (module docstring)."""

    def __init__(self, out: Path, fmt: str, group_size: int):
        self.out, self.fmt, self.group_size = out, fmt, group_size

    def path(self, i: int) -> Path:
        g = i // self.group_size * self.group_size
        folder = self.out / f"rows_{g}-{g + self.group_size}"
        folder.mkdir(exist_ok=True)
        return folder / f"data_{i}.ckpt"

    def record(self, sample: dict) -> dict:
        import torch

        S = sample["input_ids"].shape[0]
        # .clone(): a sample is a view into its whole shard, and torch.save writes a view's entire
        # storage; a same-dtype .to() / .contiguous() of a row slice would not copy.
        rec = {"input_ids": sample["input_ids"].to(torch.int64).clone(),
               "loss_mask": sample["loss_mask"].to(torch.int64).clone()}
        hidden_1SX = sample["hidden_states"].to(torch.bfloat16).reshape(1, S, -1).clone()
        if self.fmt == "specforge-eagle3":
            rec["hidden_state"] = sample[FINAL_POSTNORM].to(torch.bfloat16).reshape(1, S, -1).clone()
            rec["aux_hidden_state"] = hidden_1SX
        else:
            rec["hidden_states"] = hidden_1SX
        if self.fmt == "specforge-dspark":
            rec["target_last_hidden_states"] = sample[FINAL_POSTNORM].to(torch.bfloat16).reshape(1, S, -1).clone()
        return rec

    def write(self, i: int, sample: dict) -> int:
        import torch

        rec = self.record(sample)
        return _atomic(self.path(i), lambda p: torch.save(rec, p))

    def close(self, counts: np.ndarray) -> None:
        pass


class _SpeculatorsWriter:
    """Arrow table (``datasets`` save_to_disk layout) + ``hidden_states/hs_{i}.safetensors`` + ``token_freq.pt``."""

    def __init__(self, out: Path, run_id: str):
        import pyarrow as pa

        self.out = out
        (out / "hidden_states").mkdir()
        self.schema = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())),
                                 ("seq_len", pa.int64())])
        self.sink = pa.OSFile(str(out / ARROW_FILE), "wb")
        self.stream = pa.ipc.new_stream(self.sink, self.schema)
        self.rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
        self.run_id = run_id
        self.num_rows = 0

    def write(self, i: int, sample: dict) -> int:
        import torch
        from safetensors.torch import save_file

        hidden_SKH = sample["hidden_states"].view(sample["input_ids"].shape[0], -1, sample[FINAL_PRENORM].shape[-1])
        # Aux layers in ascending id (vLLM ids id + 1), then the pre-norm final state (vLLM id N).
        hs_SLH = torch.cat([hidden_SKH, sample[FINAL_PRENORM][:, None]], dim=1).to(torch.bfloat16).contiguous()
        tensors = {"hidden_states": hs_SLH, "token_ids": sample["input_ids"].to(torch.int64).contiguous()}
        return _atomic(self.out / "hidden_states" / f"hs_{i}.safetensors", lambda p: save_file(tensors, str(p)))

    def add_row(self, sample: dict) -> None:
        """Append sample's row to the table (called in export order, from one thread)."""
        self.rows["input_ids"].append(sample["input_ids"].tolist())
        self.rows["loss_mask"].append(sample["loss_mask"].tolist())
        self.rows["seq_len"].append(int(sample["input_ids"].shape[0]))
        if len(self.rows["seq_len"]) >= 1024:
            self.flush()

    def flush(self) -> None:
        import pyarrow as pa

        if not self.rows["seq_len"]:
            return
        self.stream.write_batch(pa.record_batch([pa.array(self.rows[n], type=self.schema.field(n).type) for n in self.rows],
                                                schema=self.schema))
        self.num_rows += len(self.rows["seq_len"])
        self.rows = {n: [] for n in self.rows}

    def close(self, counts: np.ndarray) -> None:
        import torch

        self.flush()
        self.stream.close()
        self.sink.close()
        # What datasets.Dataset.save_to_disk writes next to the Arrow file; features are left to be
        # inferred from the Arrow schema (list<int64> -> List(Value("int64"))).
        (self.out / "dataset_info.json").write_text(json.dumps(
            {"citation": "", "description": f"hsx export of run {self.run_id}", "homepage": "", "license": ""}, indent=2))
        (self.out / "state.json").write_text(json.dumps({
            "_data_files": [{"filename": ARROW_FILE}],
            "_fingerprint": uuid.uuid4().hex[:16],
            "_format_columns": None,
            "_format_kwargs": {},
            # Rows load as torch tensors, as after speculators' own set_format("torch") + save_to_disk.
            "_format_type": "torch",
            "_output_all_columns": False,
            "_split": None,
        }, indent=2))
        nonzero = np.flatnonzero(counts)
        freq = {int(v): int(counts[v]) for v in nonzero}
        _atomic(self.out / "token_freq.pt", lambda p: torch.save(freq, p))


class _EagleGeDataWriter(_SpecForgeWriter):
    """EAGLE-1/2 ``ge_data``: ``ge_data/rows_{g}-{g+G}/data_{i}.ckpt`` (module docstring)."""

    def __init__(self, out: Path, group_size: int):
        super().__init__(out / GE_DATA_DIR, "eagle-ge-data", group_size)
        self.out.mkdir()

    def record(self, sample: dict) -> dict:
        import torch

        # No batch axis: the trainer adds it ([None, :]) after slicing [:max_len].
        return {"input_ids": sample["input_ids"].to(torch.int64).clone(),
                "hidden_state": sample[FINAL_POSTNORM].to(torch.bfloat16).clone(),
                "loss_mask": sample["loss_mask"].to(torch.int64).clone()}


_UNSAFE_FILE_CHARS = re.compile(r"[^A-Za-z0-9_.-]|^\.")
#: longest file name stem kept whole; longer ids are cut and get a hash suffix (255-byte limit).
MAX_STEM = 200


def file_stem(record_id: str) -> str:
    """A file name for a record id: the id itself when it is ``[A-Za-z0-9_.-]`` only (no leading
    ``.``), else each other byte (UTF-8) as ``%XX``, so distinct ids give distinct names; ids
    whose name would pass ``MAX_STEM`` characters keep their first 150 and a sha256 suffix."""
    import hashlib

    stem = _UNSAFE_FILE_CHARS.sub(lambda m: "".join(f"%{b:02X}" for b in m.group().encode()), record_id)
    if len(stem) > MAX_STEM:
        stem = f"{stem[:150]}-{hashlib.sha256(record_id.encode()).hexdigest()[:32]}"
    return stem


def read_record_ids(run_store: Store) -> dict[int, str]:
    """``sample_index -> record id`` from the run's ``plan/samples.jsonl``."""
    return {row.sample_index: str(row.record_id) for row in SampleRow.read_all(run_store)}


class _ModelOptWriter:
    """ModelOpt offline: ``{conversation_id}.pt`` per sample (module docstring)."""

    def __init__(self, out: Path, record_ids: dict[int, str]):
        self.out, self.record_ids = out, record_ids

    def record(self, sample: dict) -> dict:
        import torch

        return {"input_ids": sample["input_ids"].to(torch.int64).clone(),
                "hidden_states": sample[FINAL_POSTNORM].to(torch.bfloat16).clone(),
                "aux_hidden_states": sample["hidden_states"].to(torch.bfloat16).clone(),
                "loss_mask": sample["loss_mask"].to(torch.int64).clone(),
                "conversation_id": self.record_ids[sample["sample_index"]]}

    def write(self, i: int, sample: dict) -> int:
        import torch

        rec = self.record(sample)
        return _atomic(self.out / f"{file_stem(rec['conversation_id'])}.pt", lambda p: torch.save(rec, p))

    def close(self, counts: np.ndarray) -> None:
        pass


# --- export ---------------------------------------------------------------------------------


def export_run(run_store: Store, fmt: str, out: Path, *, group_size: int = GROUP_SIZE, partial: bool = False,
               settings=None, progress=None, io_threads: int = IO_THREADS) -> dict:
    """Write the run at ``run_store`` to the local directory ``out`` in format ``fmt``.

    Returns the report (also written as ``out/export.json``, without the sample list).

    Raises:
        BadConfig: unknown format, a run that lacks the layers or final state the format needs,
            ``out`` exists and is not empty, the run is incomplete and ``partial`` is False, or
            (``modelopt``) two record ids would get the same file name.
        hsx.errors.FidelityError: a shard does not match its marker's sha256.
    """
    t0 = time.perf_counter()
    config = load_run(run_store)
    refuse_regenerate_run(config, run_store.url)
    warnings = check_exportable(config, fmt)
    if group_size < 1:
        raise BadConfig(f"--group-size {group_size}: must be at least 1")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadConfig(f"{out} exists and is not an empty directory: export into a new directory")
    ds = IterableHiddenStatesDataset(run_store, finals=FORMAT_FINAL[fmt], settings=settings, verify=True)
    counts, count_info = supervised_token_counts(run_store, config, partial=partial)
    if count_info["batches_missing"]:
        warnings.append(f"partial export: {count_info['batches_missing']} planned batches have no marker")
    record_ids = read_record_ids(run_store) if fmt == "modelopt" else {}
    stems: dict[str, int] = {}
    for sample, rid in record_ids.items():
        other = stems.setdefault(file_stem(rid), sample)
        if other != sample:  # the plan refuses duplicate ids, so only a cut id's hash could collide
            raise BadConfig(f"records {record_ids[other]!r} and {rid!r} (samples {other}, {sample}) would share the "
                            f"file name {file_stem(rid)}.pt; give them distinct ids")
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "speculators":
        writer = _SpeculatorsWriter(out, config.run_id)
    elif fmt == "eagle-ge-data":
        writer = _EagleGeDataWriter(out, group_size)
    elif fmt == "modelopt":
        writer = _ModelOptWriter(out, record_ids)
    else:
        writer = _SpecForgeWriter(out, fmt, group_size)
    total = count_info["samples"]
    task = progress.add_task("exporting", total=total) if progress is not None else None
    sample_index: list[int] = []
    written_bytes = 0
    pending: list[Future] = []
    supervised = 0
    try:
        with ThreadPoolExecutor(io_threads) as pool:
            for batch in sorted(ds.markers):
                for sample in ds.iter_batch(batch):
                    i = len(sample_index)
                    sample_index.append(sample["sample_index"])
                    supervised += int(sample["loss_mask"].sum())
                    if isinstance(writer, _SpeculatorsWriter):
                        writer.add_row(sample)
                    pending.append(pool.submit(writer.write, i, sample))
                    interrupts.check()  # a Ctrl-C whose KeyboardInterrupt a finalizer dropped stops the export here
                    while len(pending) >= IO_QUEUE:
                        written_bytes += pending.pop(0).result()
                        if task is not None:
                            elapsed = max(time.perf_counter() - t0, 1e-9)
                            progress.update(task, advance=1, info=f"{fmt_bytes(written_bytes)}  {fmt_bytes(written_bytes / elapsed)}/s")
            for fut in pending:
                written_bytes += fut.result()
                if task is not None:
                    progress.update(task, advance=1)
            pending.clear()
        interrupts.check()  # ... or here, after the last write, before the export is closed as complete
        writer.close(counts)
    except BaseException:
        if isinstance(writer, _SpeculatorsWriter):
            try:
                writer.stream.close()
                writer.sink.close()
            except Exception:
                pass
        raise
    if supervised != count_info["supervised_tokens"]:
        raise FidelityError(
            f"the shards hold {supervised} supervised tokens but the plan's batches {count_info['supervised_tokens']}: "
            f"the run is inconsistent; run `python -m producer verify {run_store.url}`"
        )
    (out / VOCAB_COUNTS).write_bytes(vocab_counts_bytes(counts, count_info))
    layers = config.layers
    report = {
        "format": fmt,
        "out": str(out),
        "run_id": config.run_id,
        "run_address": run_store.url,
        "model": config.model.as_dict(),
        "samples": len(sample_index),
        "supervised_tokens": supervised,
        "bytes": written_bytes,
        "hidden_size": config.model.hidden_size,
        "num_layers": layers.num_layers,
        "layer_ids": list(layers.layer_ids),
        "layer_id_convention": layers.convention,
        "vllm_layer_ids": list(layers.vllm_ids) + ([layers.num_layers] if fmt == "speculators" else []),
        "final": FORMAT_FINAL_TEXT[fmt],
        "group_size": group_size if fmt not in ("speculators", "modelopt") else None,
        "hidden_dtype": "bfloat16",
        "store_dtype": config.store_dtype,
        "warnings": warnings,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out / "export.json").write_text(json.dumps({**report, "sample_index": sample_index}, indent=1))
    return report
