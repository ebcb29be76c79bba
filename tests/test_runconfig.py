"""Run identity: which fields decide a run's id and its markers' ``config_sha256``, and that runs
written by earlier versions of hsx keep both.

Fixtures in ``tests/data/legacy-runs/`` (how they were made: its ``SOURCE.md``): a complete run
written by commit 64dc5fc, before ``identity_version`` existed, the run.json of an older commit
(f4b7035) written before ``sample_policy`` existed, and the run.json files that the last code of
identity versions 2 and 3 wrote (their ``layers`` hold prose notes and a draft config's path).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from hsx.errors import RunConflict, RunFormatError
from hsx.runconfig import (
    IDENTITY_FIELDS,
    IDENTITY_VERSION,
    IDENTITY_FIELDS_UNLESS_DEFAULT,
    NON_IDENTITY_FIELDS,
    ConfigPart,
    DatasetOptions,
    RunConfig,
    SamplePolicy,
    claim_run,
    diff_identity,
    load_run,
)
from hsx.shard import Final
from hsx.store import open_store
from producer.verify import verify_run

LEGACY = Path(__file__).resolve().parent / "data" / "legacy-runs"
LEGACY_RUN = LEGACY / "chats-307617162427"
#: What commit 64dc5fc computed for LEGACY_RUN (its markers carry it).
LEGACY_SHA = "30761716242746dd4798c255c9c5e338c71a48e06ac95d2068c4e269815eb521"
#: What commit f4b7035 computed for run-f4b7035.json.
F4B_SHA = "8bbaf20ab65cbc039b943f1d8fbe9127a9461edec5420875ba728504f151c5a4"
#: What the last identity-version-2 code (d95ffac~1) and version-3 code (a4fd82d) computed for their run.json.
V2_SHA = "ff9d4e9594d8dc1edaf18eb00405ef20da2b64073f0612d50e6e40ac7eb516f1"
V3_SHA = "219d8dcc45e58550339e252de09b5115d96715f0de773212385be2403dab4822"
#: Every older run.json fixture: (file, its identity version, the hash its code computed).
OLD_RUN_JSONS = [
    (LEGACY_RUN / "run.json", 1, LEGACY_SHA),
    (LEGACY / "run-f4b7035.json", 1, F4B_SHA),
    (LEGACY / "run-v2-d95ffac.json", 2, V2_SHA),
    (LEGACY / "run-v3-a4fd82d.json", 3, V3_SHA),
]


def _legacy_config() -> RunConfig:
    return RunConfig.from_json((LEGACY_RUN / "run.json").read_bytes())


def _copy(tmp_path: Path) -> Path:
    target = tmp_path / LEGACY_RUN.name
    shutil.copytree(LEGACY_RUN, target)
    return target


# --- runs written before identity_version existed ---------------------------------------------


def test_a_run_written_before_identity_version_keeps_its_run_id_and_marker_hash():
    raw = json.loads((LEGACY_RUN / "run.json").read_bytes())
    assert "identity_version" not in raw
    config = _legacy_config()
    assert config.identity_version == 1
    assert config.identity_sha256() == LEGACY_SHA
    assert config.default_run_id("chats") == config.run_id == LEGACY_RUN.name
    for marker in (LEGACY_RUN / "markers").glob("*.json"):
        assert json.loads(marker.read_text())["config_sha256"] == LEGACY_SHA


def test_a_run_written_before_identity_version_still_verifies(tmp_path):
    run_store = open_store(str(_copy(tmp_path)))
    report = verify_run(run_store)
    assert report["ok"], report["problems"]
    assert report["run_id"] == LEGACY_RUN.name
    assert report["batches_done"] == report["batches_planned"] == 2


def test_a_run_json_older_than_sample_policy_hashes_as_the_code_that_wrote_it():
    """Fields a run.json predates are left out of its hash, as they were when it was written."""
    raw = json.loads((LEGACY / "run-f4b7035.json").read_bytes())
    assert "sample_policy" not in raw and "enable_thinking" not in raw["tokenizer"]
    config = RunConfig.from_json((LEGACY / "run-f4b7035.json").read_bytes())
    assert config.sample_policy == SamplePolicy() and config.sample_policy.as_dict() == {}  # the field's default
    assert "enable_thinking" not in config.tokenizer.as_dict()  # a key the part did not hold is not added
    assert config.identity_sha256() == F4B_SHA
    assert config.default_run_id("chats") == config.run_id == "chats-8bbaf20ab65c"


def test_resuming_a_run_written_before_identity_version_with_the_same_options_is_accepted(tmp_path):
    """The current code plans the same config: same identity, so claim_run resumes the old run
    without rewriting its run.json."""
    run_dir = _copy(tmp_path)
    before = (run_dir / "run.json").read_bytes()
    requested = _legacy_config()
    requested.created_at = "2030-01-01T00:00:00+00:00"
    requested.dataset_source = "/elsewhere/chats.jsonl"
    assert claim_run(open_store(str(run_dir)), requested) is False
    assert (run_dir / "run.json").read_bytes() == before


# --- what is and is not part of the identity ----------------------------------------------------


def test_every_field_is_either_in_the_identity_or_declared_outside_it():
    """Adding a RunConfig field forces a decision: list it in NON_IDENTITY_FIELDS, in
    IDENTITY_FIELDS_UNLESS_DEFAULT, or bump IDENTITY_VERSION."""
    names = set(RunConfig.field_names())
    identity = set(IDENTITY_FIELDS[IDENTITY_VERSION])
    assert identity.isdisjoint(NON_IDENTITY_FIELDS)
    assert identity.isdisjoint(IDENTITY_FIELDS_UNLESS_DEFAULT) and set(NON_IDENTITY_FIELDS).isdisjoint(IDENTITY_FIELDS_UNLESS_DEFAULT)
    assert names == identity | set(NON_IDENTITY_FIELDS) | set(IDENTITY_FIELDS_UNLESS_DEFAULT)


def test_version_1_hashes_exactly_what_runs_before_identity_version_hashed():
    assert IDENTITY_FIELDS[1] == ("model", "model_name", "layers", "max_length", "batch_tokens", "max_batch_samples",
                                  "store_dtype", "tokenizer", "dataset_fingerprint", "limit", "sample_policy",
                                  "schema_version")


def _new_config(**changes) -> RunConfig:
    """The legacy run's options as this code's planner records them (identity version 3: content as
    text, the streamed plan's windows)."""
    return dataclasses.replace(_legacy_config(), **{"identity_version": IDENTITY_VERSION,
                                                    "special_tokens_in_content": "text",
                                                    "plan_windows": [1024, 32768], **changes})


def test_new_runs_record_their_identity_version_and_it_round_trips():
    config = _new_config()
    written = json.loads(config.to_json())
    assert written["identity_version"] == IDENTITY_VERSION == 4
    assert written["special_tokens_in_content"] == "text"
    again = RunConfig.from_json(config.to_json())
    assert again == config and again.identity_sha256() == config.identity_sha256() != LEGACY_SHA


def test_a_version_1_run_json_is_written_back_as_version_1_with_its_hash():
    legacy = _legacy_config()
    assert json.loads(legacy.to_json())["identity_version"] == 1
    again = RunConfig.from_json(legacy.to_json())
    assert again.identity_sha256() == LEGACY_SHA


# --- version 2: special tokens in content, content revisions -----------------------------------


def test_version_2_hashes_version_1_and_how_special_tokens_in_content_were_tokenised():
    assert IDENTITY_FIELDS[2] == IDENTITY_FIELDS[1] + ("special_tokens_in_content",)
    identity = _new_config(identity_version=2).identity()
    assert set(identity) == set(IDENTITY_FIELDS[2]) | {"identity_version"}
    assert identity["identity_version"] == 2 and identity["special_tokens_in_content"] == "text"


# --- version 3: the streamed plan's windows, which records are read ---------------------------


def test_version_3_hashes_version_2_the_plan_windows_and_the_dataset_options():
    """The windows decide which samples share a batch; shuffle, seed, sample, split and subset which
    records are read: both decide the shards' bytes. The source's description and the chat template's
    path are recorded but never hashed (the bytes they name are: dataset_fingerprint, the template's sha256)."""
    assert IDENTITY_FIELDS[3] == IDENTITY_FIELDS[2] + ("plan_windows", "dataset_options")
    config = _new_config(identity_version=3)
    assert set(config.identity()) == set(IDENTITY_FIELDS[3]) | {"identity_version"}
    assert config.identity()["identity_version"] == 3
    other_windows = _new_config(identity_version=3, plan_windows=[512, 32768])
    shuffled = _new_config(identity_version=3, dataset_options=DatasetOptions(shuffle=True, seed=1))
    assert len({c.default_run_id("chats") for c in (config, other_windows, shuffled)}) == 3
    moved = _new_config(identity_version=3, dataset={"kind": "files", "files": [{"name": "x.jsonl", "bytes": 3}]},
                        chat_template_file="/elsewhere/template.jinja", dataset_source="/elsewhere/chats.jsonl")
    assert moved.identity_sha256() == config.identity_sha256()


def test_a_version_2_run_reads_as_sorted_whole_with_every_record_in_order():
    """Runs before the streamed plan sorted the whole dataset: plan_windows reads as None, dataset_options as {}."""
    old = RunConfig.from_json(json.dumps({k: v for k, v in json.loads(_new_config(identity_version=2).to_json()).items()
                                          if k not in ("plan_windows", "dataset_options", "dataset",
                                                       "chat_template_file")}).encode())
    assert old.identity_version == 2 and old.plan_windows is None and old.dataset_options == DatasetOptions()
    assert set(old.identity()) == set(IDENTITY_FIELDS[2]) | {"identity_version"}


def test_a_version_1_run_reads_as_special_tokens_in_content_special_and_does_not_hash_it():
    """Runs before the option tokenised content's special-token strings as special tokens: the
    default of the field says so, and their hash is the one their markers carry."""
    legacy = _legacy_config()
    assert "special_tokens_in_content" not in json.loads((LEGACY_RUN / "run.json").read_bytes())
    assert legacy.special_tokens_in_content == "special"
    assert "special_tokens_in_content" not in legacy.identity()
    assert legacy.identity_sha256() == LEGACY_SHA


def test_the_content_token_mode_decides_the_run_id():
    text, special = _new_config(), _new_config(special_tokens_in_content="special")
    assert text.default_run_id("chats") != special.default_run_id("chats")


def test_the_same_options_planned_by_this_code_are_another_run_than_a_version_1_run(tmp_path):
    """A version-1 run keeps its id; the same options now give a version-2 identity and another id,
    and claiming the old id with it is refused, naming what differs."""
    run_dir = _copy(tmp_path)
    requested = _new_config()
    assert requested.default_run_id("chats") != LEGACY_RUN.name
    with pytest.raises(RunConflict, match="special_tokens_in_content: stored \"special\" != requested \"text\""):
        claim_run(open_store(str(run_dir)), requested)


def test_a_new_field_outside_the_identity_does_not_change_the_run_id():
    @dataclasses.dataclass
    class FutureRunConfig(RunConfig):
        spool_hint: str = "nvme"

    base = _legacy_config()
    future = FutureRunConfig(**{k: copy.deepcopy(getattr(base, k)) for k in RunConfig.field_names()}, spool_hint="shm")
    assert future.identity_sha256() == base.identity_sha256()
    assert future.default_run_id("chats") == base.default_run_id("chats") == LEGACY_RUN.name


def test_a_run_json_with_a_field_this_code_does_not_know_loads_keeps_it_and_still_verifies(tmp_path):
    """A newer hsx may add recorded fields; this code loads such a run, with the same identity."""
    run_dir = _copy(tmp_path)
    raw = json.loads((run_dir / "run.json").read_bytes())
    raw["identity_version"] = 1
    raw["spool_hint"] = "nvme"
    (run_dir / "run.json").write_text(json.dumps(raw))
    config = load_run(open_store(str(run_dir)))
    assert config.extra == {"spool_hint": "nvme", "stats": {}}  # stats: always {}, no longer a field
    assert json.loads(config.to_json())["spool_hint"] == "nvme"
    assert config.identity_sha256() == LEGACY_SHA
    assert verify_run(open_store(str(run_dir)))["ok"]


@pytest.mark.parametrize("name,value", [
    ("model", {"revision": "another-checkpoint"}),
    ("layers", {"layer_ids": (1, 2, 4)}),
    ("max_length", 128),
    ("batch_tokens", 256),
    ("max_batch_samples", 2),
    ("store_dtype", "float32"),
    ("tokenizer", {"chat_template_sha256": "0" * 64}),
    ("dataset_fingerprint", "f" * 64),
    ("limit", 3),
    ("sample_policy", {"over_length": "drop"}),
    ("schema_version", 2),
])
def test_changing_an_identity_field_changes_the_run_id(name, value):
    base = _legacy_config()
    changed = _legacy_config()
    old = getattr(changed, name)
    setattr(changed, name, old.model_copy(update=value) if isinstance(old, ConfigPart) else value)
    assert changed.default_run_id("chats") != base.default_run_id("chats")
    assert changed.identity_sha256() != LEGACY_SHA
    new_base, new_changed = _new_config(), _new_config(**{name: getattr(changed, name)})
    assert new_changed.default_run_id("chats") != new_base.default_run_id("chats")


@pytest.mark.parametrize("name,value", [
    ("run_id", "another-id"),
    ("created_at", "2030-01-01T00:00:00+00:00"),
    ("dataset_source", "/elsewhere/chats.jsonl"),
    ("chat_template_file", "/elsewhere/template.jinja"),
])
def test_recorded_fields_outside_the_identity_do_not_change_the_run_id(name, value):
    changed = _legacy_config()
    setattr(changed, name, value)
    assert changed.identity_sha256() == LEGACY_SHA


def test_a_run_with_the_same_id_and_another_identity_is_refused_naming_the_field(tmp_path):
    run_dir = _copy(tmp_path)
    requested = _legacy_config()
    requested.max_length = 128
    with pytest.raises(RunConflict, match="max_length: stored 64 != requested 128"):
        claim_run(open_store(str(run_dir)), requested)


def test_a_run_json_of_an_unknown_identity_version_is_refused_with_what_to_do(tmp_path):
    run_dir = _copy(tmp_path)
    raw = json.loads((run_dir / "run.json").read_bytes())
    raw["identity_version"] = IDENTITY_VERSION + 1
    (run_dir / "run.json").write_text(json.dumps(raw))
    with pytest.raises(RunFormatError, match="newer hsx, upgrade"):
        load_run(open_store(str(run_dir)))


# --- added tokens in content (issue 22, item 2): hashed only when not the default --------------


def test_added_tokens_in_content_is_hashed_only_when_text_so_earlier_runs_keep_their_ids():
    """Every run before the choice kept the ids of non-special added tokens (``token``): a run.json
    without the field reads as ``token``, and ``token`` is not hashed, so those runs and the same
    options planned now keep one id; ``text`` gives another id and is named in a conflict."""
    legacy = _legacy_config()
    assert legacy.added_tokens_in_content == "token" and legacy.identity_sha256() == LEGACY_SHA
    config = _new_config()
    written = json.loads(config.to_json())
    assert written["added_tokens_in_content"] == "token"
    without = RunConfig.from_json(json.dumps({k: v for k, v in written.items() if k != "added_tokens_in_content"}).encode())
    assert without.added_tokens_in_content == "token"
    assert "added_tokens_in_content" not in config.identity()
    assert without.identity_sha256() == config.identity_sha256()
    as_text = _new_config(added_tokens_in_content="text")
    assert as_text.identity()["added_tokens_in_content"] == "text"
    assert as_text.default_run_id("chats") != config.default_run_id("chats")
    assert RunConfig.from_json(as_text.to_json()).identity_sha256() == as_text.identity_sha256()
    assert diff_identity(config.identity(), as_text.identity()) == [
        'added_tokens_in_content: stored null != requested "text"']


def test_the_planner_records_the_added_token_mode_and_tokenises_content_by_it(tmp_path, tiny_cache):
    """``--added-tokens-in-content text``: run.json says so, and a user's literal <think> is planned as
    text (no 151667 in the sample); the default plans it as the token and records ``token``."""
    from hsx.plan import read_batch
    from producer.planner import plan_run
    from plans import plan_options, plan_settings

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "t", "messages": [{"role": "user", "content": "What is <think> for?"},
                                                         {"role": "assistant", "content": "Reasoning."}]}) + "\n")
    seen = {}
    for mode in ("token", "text"):
        run = plan_run(plan_options(tmp_path / mode, chats, added_tokens_in_content=mode), plan_settings(tiny_cache))
        stored = json.loads((tmp_path / mode / run.config.run_id / "run.json").read_bytes())
        assert stored["added_tokens_in_content"] == mode
        (batch,) = run.batches
        seen[mode] = read_batch(run.run_store, batch.batch).input_ids_T.tolist()
    assert seen["token"].count(151667) == 2  # the user's and the template's (the reply's empty block)
    assert seen["text"].count(151667) == 1


# --- version 4: typed parts, only the fields that decide the bytes are hashed -------------------


@pytest.mark.parametrize("path,version,sha", OLD_RUN_JSONS, ids=lambda v: getattr(v, "name", str(v))[:24])
def test_an_old_run_json_of_each_identity_version_keeps_its_id_and_marker_hash(path, version, sha):
    """Versions 1-3 hashed each part as stored, prose and paths included: read into the typed parts and
    written back, every old run.json still hashes to what its code wrote into its markers."""
    config = RunConfig.from_json(path.read_bytes())
    assert config.identity_version == version
    assert config.identity_sha256() == sha
    assert config.default_run_id("chats") == config.run_id == f"chats-{sha[:12]}"
    again = RunConfig.from_json(config.to_json())
    assert again.identity_sha256() == sha
    raw = json.loads(path.read_bytes())
    for name in ("model", "layers", "tokenizer", "sample_policy", "dataset_options"):
        if name in raw:  # each part writes back exactly the keys it was read with
            assert json.loads(config.to_json())[name] == raw[name]


def test_the_version_2_and_3_fixtures_hold_the_prose_and_the_path_those_versions_hashed():
    """So that the test above proves what it says: their layers carry notes and a draft config's path."""
    for path, version, _sha in OLD_RUN_JSONS[2:]:
        layers = RunConfig.from_json(path.read_bytes()).layers
        assert layers.notes and layers.source.startswith("/tmp/legacy/draft/config.json: ")
        assert layers.layer_ids == (1, 3, 7) and layers.final == "postnorm"


def _v3_run() -> RunConfig:
    return RunConfig.from_json((LEGACY / "run-v3-a4fd82d.json").read_bytes())


def _as_v4(config: RunConfig, **layer_changes) -> RunConfig:
    """The same run planned by this code (identity version 4), its layers changed by ``layer_changes``."""
    return dataclasses.replace(config, identity_version=4, layers=config.layers.model_copy(update=layer_changes))


def test_a_version_4_id_does_not_change_with_the_layers_prose_notes_or_draft_config_path():
    base = _as_v4(_v3_run())
    reworded = _as_v4(_v3_run(), convention="the residual stream after decoder layer i",
                      notes=["the last layer's raw output, before the final norm"])
    moved = _as_v4(_v3_run(), source="/home/me/drafts/other-copy/config.json: dflash_config.target_layer_ids (output-of)")
    assert base.identity_sha256() == reworded.identity_sha256() == moved.identity_sha256()
    assert base.default_run_id("chats") == moved.default_run_id("chats") != _v3_run().run_id
    # under version 3 the same changes did change the id: why version 4 exists
    v3_moved = dataclasses.replace(_v3_run(), layers=moved.layers)
    assert v3_moved.identity_sha256() != V3_SHA


@pytest.mark.parametrize("change", [{"layer_ids": (1, 3, 6)}, {"final": Final.BOTH}])
def test_a_version_4_id_changes_with_a_layer_id_or_the_final_states(change):
    base = _as_v4(_v3_run())
    changed = _as_v4(_v3_run(), **change)
    assert changed.default_run_id("chats") != base.default_run_id("chats")
    assert diff_identity(base.identity(), changed.identity())[0].startswith(f"layers.{next(iter(change))}: stored")


def test_version_4_hashes_the_typed_fields_of_each_part_and_not_the_model_name_repeat():
    config = _as_v4(_v3_run())
    identity = config.identity()
    assert set(identity) == set(IDENTITY_FIELDS[4]) | {"identity_version"} and "model_name" not in identity
    assert identity["layers"] == {"layer_ids": [1, 3, 7], "final": "postnorm"}
    assert set(identity["model"]) == {"name", "model_type", "num_layers", "hidden_size", "revision"}
    assert identity["tokenizer"]["class"] == "Qwen2Tokenizer" and "enable_thinking" in identity["tokenizer"]
    assert identity["dataset_options"] == {"shuffle": True, "seed": 7}
    # what is hashed still decides the id: the model's revision, the sample policy, the dataset order
    for changed in (dataclasses.replace(config, model=config.model.model_copy(update={"revision": "sha256:" + "1" * 64})),
                    dataclasses.replace(config, sample_policy=config.sample_policy.model_copy(update={"over_length": "drop"})),
                    dataclasses.replace(config, dataset_options=DatasetOptions(shuffle=True, seed=8)),
                    dataclasses.replace(config, tokenizer=config.tokenizer.model_copy(update={"enable_thinking": True}))):
        assert changed.identity_sha256() != config.identity_sha256()
    assert dataclasses.replace(config, model_name="./elsewhere/tiny").identity_sha256() == config.identity_sha256()


def test_version_4_hashes_the_dataset_options_by_what_they_change_not_how_they_were_spelled():
    """A seed without shuffle or sample reads every record in order: the same records as no option."""
    config = _as_v4(_v3_run())
    in_order = dataclasses.replace(config, dataset_options=DatasetOptions())
    spelled = dataclasses.replace(config, dataset_options=DatasetOptions(shuffle=False, seed=3))
    assert in_order.identity_sha256() == spelled.identity_sha256() != config.identity_sha256()


def test_a_version_3_run_is_resumed_by_this_code_under_its_run_id_when_only_the_prose_differs(tmp_path):
    """Compared at version 4 (the newer), a version-3 run and the same options with the draft config at
    another path agree: claim_run resumes it and leaves its run.json (and so its id) as it was."""
    run_dir = tmp_path / _v3_run().run_id
    run_dir.mkdir()
    (run_dir / "run.json").write_bytes((LEGACY / "run-v3-a4fd82d.json").read_bytes())
    requested = _as_v4(_v3_run(), source="/elsewhere/config.json: dflash_config.target_layer_ids (output-of)")
    assert claim_run(open_store(str(run_dir)), requested) is False
    assert load_run(open_store(str(run_dir))).identity_sha256() == V3_SHA
    with pytest.raises(RunConflict, match=r"layers.layer_ids: stored \[1, 3, 7\] != requested \[1, 3, 6\]"):
        claim_run(open_store(str(run_dir)), _as_v4(_v3_run(), layer_ids=(1, 3, 6)))


def test_a_part_keeps_the_keys_it_does_not_know_and_never_hashes_them_from_version_4():
    raw = json.loads((LEGACY / "run-v3-a4fd82d.json").read_bytes())
    raw["identity_version"] = 4
    raw["layers"]["draft_model"] = "z-lab/dflash-draft"  # a key a newer hsx might record
    config = RunConfig.from_json(json.dumps(raw).encode())
    assert json.loads(config.to_json())["layers"]["draft_model"] == "z-lab/dflash-draft"
    del raw["layers"]["draft_model"]
    assert config.identity_sha256() == RunConfig.from_json(json.dumps(raw).encode()).identity_sha256()


def test_a_run_json_with_a_part_of_the_wrong_shape_is_refused_naming_the_field():
    raw = json.loads((LEGACY / "run-v3-a4fd82d.json").read_bytes())
    raw["layers"]["layer_ids"] = "1,3,7"
    with pytest.raises(RunFormatError, match=r"layers\.layer_ids"):
        RunConfig.from_json(json.dumps(raw).encode())
    del raw["model"]["hidden_size"]
    with pytest.raises(RunFormatError, match=r"model\.hidden_size: Field required"):
        RunConfig.from_json(json.dumps(raw).encode())


def test_a_part_given_as_a_dict_is_refused():
    with pytest.raises(TypeError, match="RunConfig.layers is a dict, not a LayersConfig"):
        dataclasses.replace(_v3_run(), layers={"layer_ids": [1, 3, 7], "final": "postnorm"})


# --- a local checkpoint is hashed by its bytes, not its path --------------------------------------

#: What identity version 4 computed, before ``model.files_revision`` existed, for the version-3
#: fixture planned by this code with a hub id (``Qwen/Qwen3-8B`` at a commit) and with a local
#: checkpoint directory (``/data/ckpt``): both keep it.
V4_HUB_SHA = "200d051c9d613927c7dda1d01b2293eb5a505cdfba48cce78efb073899255877"
V4_LOCAL_BEFORE_FILES_SHA = "9d59169b196a630abfd46e3b17cc68d80ddd689e8ba3862a5e0f10a986d086a7"


def _with_model(config: RunConfig, **model) -> RunConfig:
    return dataclasses.replace(config, model=config.model.model_copy(update=model),
                               model_name=model.get("name", config.model_name))


def test_a_hub_id_and_a_local_run_planned_before_files_revision_keep_their_version_4_ids():
    base = _as_v4(_v3_run())
    hub = _with_model(base, name="Qwen/Qwen3-8B", revision="b968826d9c46dd6066d109eabc6255188de91218")
    assert hub.identity_sha256() == V4_HUB_SHA and hub.identity()["model"]["name"] == "Qwen/Qwen3-8B"
    before = _with_model(base, name="/data/ckpt")
    assert before.identity_sha256() == V4_LOCAL_BEFORE_FILES_SHA, "hashed by its name, as when it was planned"
    assert _with_model(base, name="/elsewhere/ckpt").identity_sha256() != V4_LOCAL_BEFORE_FILES_SHA


def test_a_local_checkpoint_with_files_revision_is_hashed_by_its_bytes_not_its_path():
    base = _with_model(_as_v4(_v3_run()), name="/data/ckpt", files_revision="sha256:" + "2" * 64)
    moved = _with_model(base, name="/mnt/copy/ckpt")
    assert "name" not in base.identity()["model"] and base.identity()["model"]["files_revision"] == "sha256:" + "2" * 64
    assert moved.default_run_id("chats") == base.default_run_id("chats")
    for other in (_with_model(base, revision="sha256:" + "1" * 64), _with_model(base, files_revision="sha256:" + "3" * 64)):
        assert other.default_run_id("chats") != base.default_run_id("chats")
    again = RunConfig.from_json(base.to_json())
    assert again.model.files_revision == base.model.files_revision and again.identity_sha256() == base.identity_sha256()


def test_a_local_run_planned_before_files_revision_is_resumed_under_its_run_id_from_the_same_path(tmp_path):
    """Its run.json hashed the name: a request of this code (with files_revision) is compared by the name
    as that run was, so the same path resumes it (run.json untouched) and another path is a conflict."""
    before = dataclasses.replace(_with_model(_as_v4(_v3_run()), name="/data/ckpt"), run_id="local-run")
    run_dir = tmp_path / "local-run"
    run_dir.mkdir()
    (run_dir / "run.json").write_bytes(before.to_json())
    now = _with_model(before, files_revision="sha256:" + "2" * 64)
    assert claim_run(open_store(str(run_dir)), now) is False
    assert load_run(open_store(str(run_dir))).identity_sha256() == V4_LOCAL_BEFORE_FILES_SHA
    with pytest.raises(RunConflict, match=r'model.name: stored "/data/ckpt" != requested "/mnt/copy/ckpt"'):
        claim_run(open_store(str(run_dir)), _with_model(now, name="/mnt/copy/ckpt"))


def test_the_planner_gives_one_run_id_for_one_draft_config_at_two_paths(tmp_path, tiny_cache):
    """The issue this version fixes, end to end: the same draft config copied elsewhere plans the same run."""
    from plans import plan_options, plan_settings
    from producer.planner import build_config

    draft = {"dflash_config": {"target_layer_ids": [1, 3, 7]}}
    ids = []
    for where in ("a", "b/c"):
        path = tmp_path / where / "config.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(draft))
        config, _tok, _source = build_config(plan_options(tmp_path / "out", LEGACY / "chats.jsonl", draft_config=str(path)),
                                             plan_settings(tiny_cache))
        assert config.identity_version == IDENTITY_VERSION and config.layers.source.startswith(str(path))
        ids.append(config.run_id)
    assert ids[0] == ids[1]
