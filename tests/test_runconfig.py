"""Run identity: which fields decide a run's id and its markers' ``config_sha256``, and that runs
written by earlier versions of hsx keep both.

Fixtures in ``tests/data/legacy-runs/`` (how they were made: its ``SOURCE.md``): a complete run
written by commit 64dc5fc, before ``identity_version`` existed, and the run.json of an older commit
(f4b7035) written before ``sample_policy`` existed.
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
    RunConfig,
    claim_run,
    diff_identity,
    load_run,
)
from hsx.store import open_store
from producer.verify import verify_run

LEGACY = Path(__file__).resolve().parent / "data" / "legacy-runs"
LEGACY_RUN = LEGACY / "chats-307617162427"
#: What commit 64dc5fc computed for LEGACY_RUN (its markers carry it).
LEGACY_SHA = "30761716242746dd4798c255c9c5e338c71a48e06ac95d2068c4e269815eb521"
#: What commit f4b7035 computed for run-f4b7035.json.
F4B_SHA = "8bbaf20ab65cbc039b943f1d8fbe9127a9461edec5420875ba728504f151c5a4"


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
    assert config.sample_policy == {}  # the field's default, for code that reads it
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
    assert written["identity_version"] == IDENTITY_VERSION == 3
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
    config = _new_config()
    assert set(config.identity()) == set(IDENTITY_FIELDS[3]) | {"identity_version"}
    assert config.identity()["identity_version"] == 3
    other_windows = _new_config(plan_windows=[512, 32768])
    shuffled = _new_config(dataset_options={"shuffle": True, "seed": 1})
    assert len({c.default_run_id("chats") for c in (config, other_windows, shuffled)}) == 3
    moved = _new_config(dataset={"kind": "files", "files": [{"name": "x.jsonl", "bytes": 3}]},
                        chat_template_file="/elsewhere/template.jinja", dataset_source="/elsewhere/chats.jsonl")
    assert moved.identity_sha256() == config.identity_sha256()


def test_a_version_2_run_reads_as_sorted_whole_with_every_record_in_order():
    """Runs before the streamed plan sorted the whole dataset: plan_windows reads as None, dataset_options as {}."""
    old = RunConfig.from_json(json.dumps({k: v for k, v in json.loads(_new_config(identity_version=2).to_json()).items()
                                          if k not in ("plan_windows", "dataset_options", "dataset",
                                                       "chat_template_file")}).encode())
    assert old.identity_version == 2 and old.plan_windows is None and old.dataset_options == {}
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
    assert config.extra == {"spool_hint": "nvme"}
    assert json.loads(config.to_json())["spool_hint"] == "nvme"
    assert config.identity_sha256() == LEGACY_SHA
    assert verify_run(open_store(str(run_dir)))["ok"]


@pytest.mark.parametrize("name,value", [
    ("model", {"revision": "another-checkpoint"}),
    ("model_name", "other-model"),
    ("layers", {"layer_ids": [1, 2, 4]}),
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
    setattr(changed, name, {**old, **value} if isinstance(old, dict) else value)
    assert changed.default_run_id("chats") != base.default_run_id("chats")
    assert changed.identity_sha256() != LEGACY_SHA
    new_base, new_changed = _new_config(), _new_config(**{name: getattr(changed, name)})
    assert new_changed.default_run_id("chats") != new_base.default_run_id("chats")


@pytest.mark.parametrize("name,value", [
    ("run_id", "another-id"),
    ("created_at", "2030-01-01T00:00:00+00:00"),
    ("dataset_source", "/elsewhere/chats.jsonl"),
    ("stats", {"samples": 4}),
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
        seen[mode] = read_batch(run.run_store, batch["batch"]).input_ids_T.tolist()
    assert seen["token"].count(151667) == 2  # the user's and the template's (the reply's empty block)
    assert seen["text"].count(151667) == 1
