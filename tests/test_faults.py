"""Fault injection (``workers/faults.py``) is a test-only hook from outside the task's steps: the
``HSX_FAULTS`` variable, read by that module alone and no user setting; without it every hook is a
no-op and the store is the store itself."""

from __future__ import annotations

import errno

import pytest

from hsx.errors import BadConfig, StoreError


class _Store:
    """A store that keeps what ``write_stream`` is given and answers one other call."""

    url = "mem://"

    def __init__(self):
        self.written: dict[str, bytes] = {}

    def write_stream(self, key, pieces):
        data = b"".join(bytes(p) for p in pieces)
        self.written[key] = data
        return len(data), "sha"

    def size(self, key):
        return len(self.written[key]) if key in self.written else None


@pytest.fixture
def fault_env(monkeypatch):
    from workers import faults

    faults.reset()
    monkeypatch.delenv(faults.ENV, raising=False)
    yield lambda spec: monkeypatch.setenv(faults.ENV, spec)
    faults.reset()


def test_without_HSX_FAULTS_every_hook_does_nothing_and_the_store_is_the_store_itself(fault_env):
    from workers import faults

    hooks = faults.hooks()
    store, write = _Store(), object()
    assert hooks is faults.NO_FAULTS
    assert hooks.store(store, "b000001") is store and hooks.spool_writer(write) is write
    assert hooks.pause("forward", "b000001") is None and hooks.at_load() is None and hooks.at_received() is None


def test_HSX_FAULTS_is_no_setting_of_the_user_yet_is_not_refused_as_a_misspelling(fault_env):
    from settings import Settings, load_settings, unknown_variables

    fault_env("pause_forward=1")
    assert "faults" not in Settings.model_fields
    assert unknown_variables({"HSX_FAULTS": "pause_forward=1"}) == []
    load_settings()  # does not raise


def test_a_faulty_store_fails_the_first_N_shard_writes_and_passes_every_other_call_through(fault_env):
    from workers import faults

    fault_env("store_down=1")
    store = _Store()
    faulty = faults.hooks().store(store, "b000001")
    with pytest.raises(StoreError) as caught:
        faulty.write_stream("shards/a", [memoryview(b"head"), memoryview(b"body")])
    assert caught.value.transient and store.written == {}
    assert faulty.write_stream("shards/a", [memoryview(b"head"), memoryview(b"body")]) == (8, "sha")
    assert faulty.size("shards/a") == 8 and faulty.url == "mem://"


def test_store_full_fails_a_shard_write_after_its_header_and_counts_across_the_process(fault_env):
    from workers import faults

    fault_env("store_full=1")
    with pytest.raises(OSError) as caught:
        faults.hooks().store(_Store(), "b000001").write_stream("shards/a", [memoryview(b"head"), memoryview(b"body")])
    assert caught.value.errno == errno.ENOSPC
    # the next batch's store, same process: the one injection is spent
    assert faults.hooks().store(_Store(), "b000002").write_stream("shards/b", [memoryview(b"x")]) == (1, "sha")


def test_spool_full_fails_the_first_N_spool_writes_with_ENOSPC(fault_env, tmp_path):
    from workers import faults

    fault_env("spool_full=1")
    write = faults.hooks().spool_writer(lambda path, pieces: (0, "sha"))
    with pytest.raises(OSError) as caught:
        write(tmp_path / "s", [])
    assert caught.value.errno == errno.ENOSPC
    assert write(tmp_path / "s", []) == (0, "sha")


def test_a_spec_with_an_unknown_entry_is_refused_with_the_entries_there_are(fault_env):
    from workers import faults

    fault_env("pause_nowhere=1")
    with pytest.raises(BadConfig, match="pause_<point>=S"):
        faults.hooks()
