"""Bad ``HSX_*`` values: refused when the settings are loaded, one line per value with the variable,
the value (secrets hidden, URL passwords masked), the rule and the fix; never pydantic's raw
report. ``python -m workers`` (tests/test_launcher.py) and ``python -m producer`` print it as is."""

from __future__ import annotations

import os

import pytest

from jobfixtures import clean_env, run_cli
from hsx.errors import BadConfig, BadSettings
from settings import SECRET_FIELDS, get_settings, load_settings


@pytest.fixture
def hsx_env(monkeypatch):
    """This process's environment without any HSX_* variable; ``set(NAME=value)`` adds some."""
    for key in list(os.environ):
        if key.upper().startswith("HSX_"):
            monkeypatch.delenv(key)
    get_settings.cache_clear()

    def set_(**values):
        for name, value in values.items():
            monkeypatch.setenv(f"HSX_{name.upper()}", value)
    yield set_
    get_settings.cache_clear()


def test_each_bad_value_is_one_line_with_variable_value_rule_and_fix(hsx_env):
    hsx_env(max_length="4", heartbeat_s="soon", trust_remote_code="maybe")
    with pytest.raises(BadSettings) as caught:
        load_settings(_env_file=None)
    err = caught.value
    assert isinstance(err, BadConfig)
    assert {p["variable"]: (p["value"], p["source"]) for p in err.problems} == {
        "HSX_MAX_LENGTH": ("'4'", "environment"),
        "HSX_HEARTBEAT_S": ("'soon'", "environment"),
        "HSX_TRUST_REMOTE_CODE": ("'maybe'", "environment"),
    }
    lines = str(err).splitlines()
    assert lines[0] == "3 bad settings:" and len(lines) == 4, lines
    assert ("  HSX_MAX_LENGTH='4' (environment): should be greater than or equal to 8; "
            "fix: set a valid value, or unset HSX_MAX_LENGTH for the default 4096") in lines
    assert any(line.startswith("  HSX_HEARTBEAT_S='soon' (environment): should be a valid number") for line in lines), lines
    assert any("HSX_TRUST_REMOTE_CODE='maybe'" in line and "(true/false, 1/0, yes/no, on/off)" in line
               and "for the default false" in line for line in lines), lines
    assert "pydantic" not in str(err) and "validation error" not in str(err).lower()


def test_one_bad_value_is_one_line(hsx_env):
    hsx_env(workers_per_node="0")
    with pytest.raises(BadSettings) as caught:
        get_settings()
    assert str(caught.value) == ("bad setting HSX_WORKERS_PER_NODE='0' (environment): should be greater than or equal "
                                 "to 1; fix: set a valid value, or unset HSX_WORKERS_PER_NODE")


def test_a_misspelled_variable_is_refused_with_the_setting_it_is_closest_to(hsx_env):
    """``HSX_BATCH_TOKEN`` would be ignored for a whole run: refused, naming ``HSX_BATCH_TOKENS``; a name close to
    nothing is refused too, and the variables the scripts read (``HSX_TEST_PROCESSES``) are not settings to refuse."""
    hsx_env(batch_token="5", frobnicate="1", test_processes="2")
    with pytest.raises(BadSettings) as caught:
        load_settings(_env_file=None)
    message = str(caught.value)
    assert message.startswith("HSX_BATCH_TOKEN (did you mean HSX_BATCH_TOKENS?), HSX_FROBNICATE: not settings"), message
    assert "fix: correct the name, or unset it" in message and "TEST_PROCESSES" not in message
    assert [p["variable"] for p in caught.value.problems] == ["HSX_BATCH_TOKEN", "HSX_FROBNICATE"]


def test_a_failed_load_is_not_cached(hsx_env, monkeypatch):
    hsx_env(batch_tokens="lots")
    with pytest.raises(BadSettings):
        get_settings()
    monkeypatch.setenv("HSX_BATCH_TOKENS", "4096")
    assert get_settings().batch_tokens == 4096


def test_a_url_is_shown_with_its_password_masked_and_a_secret_not_at_all(hsx_env):
    hsx_env(broker_url="http://user:broker-pw-123@10.0.0.1:6379/0")
    with pytest.raises(BadSettings) as caught:
        load_settings(_env_file=None, s3_secret_access_key=12345, flower_basic_auth=["user", "flower-pw"])
    text = str(caught.value)
    assert "broker-pw-123" not in text and "12345" not in text and "flower-pw" not in text
    assert "HSX_BROKER_URL='http://user:***@10.0.0.1:6379/0' (environment): should be a Redis URL" in text, text
    secrets = {p["variable"]: p["value"] for p in caught.value.problems if p["field"] in SECRET_FIELDS}
    assert secrets == {"HSX_S3_SECRET_ACCESS_KEY": "***", "HSX_FLOWER_BASIC_AUTH": "***"}, caught.value.problems


def test_a_value_from_the_env_file_is_named_as_not_from_the_environment(hsx_env, tmp_path):
    env_file = tmp_path / ".env"
    env_file.write_text("HSX_SPOOL_MAX_FRACTION=1.5\n")
    with pytest.raises(BadSettings) as caught:
        load_settings(_env_file=env_file)
    assert str(caught.value) == ("bad setting HSX_SPOOL_MAX_FRACTION='1.5' (.env file or argument): should be less than "
                                 "or equal to 1; fix: set a valid value, or unset HSX_SPOOL_MAX_FRACTION for the default 0.8")


def test_the_producer_cli_prints_the_bad_setting_not_a_traceback(tmp_path):
    """``python -m producer``: exit 2 and the line, even for a value that looks like rich markup."""
    env = clean_env(max_length="[bold]4[/bold]", cache_dir=tmp_path / "cache")
    env["COLUMNS"] = "400"  # one line, as rich would wrap it at 80 columns on a pipe
    proc = run_cli("producer", ["status", str(tmp_path / "no-run")], env, timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "ValidationError" not in proc.stderr
    assert ("error: bad setting HSX_MAX_LENGTH='[bold]4[/bold]' (environment): should be a valid integer, unable to "
            "parse string as an integer; fix: set a valid value, or unset HSX_MAX_LENGTH for the default 4096") in proc.stderr, proc.stderr


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "gpu0"])
def test_a_device_a_worker_cannot_run_on_is_refused_at_start_with_the_choices(hsx_env, device):
    """HSX_DEVICE is checked when the settings load (before any planning or worker start), not by torch 60 s later
    inside the first batch."""
    hsx_env(device=device)
    with pytest.raises(BadSettings) as caught:
        load_settings(_env_file=None)
    assert f"HSX_DEVICE={device!r}" in str(caught.value) and "cpu, cuda or cuda:N" in str(caught.value)


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:3", " cuda:0 "])
def test_the_devices_torch_names_are_taken(hsx_env, device):
    hsx_env(device=device)
    assert load_settings(_env_file=None).device == device.strip()


def test_run_with_a_device_no_worker_can_run_on_exits_2_before_planning(tmp_path):
    """``producer run`` with HSX_DEVICE=tpu: exit 2 with the line; no run, no broker, no worker started."""
    env = clean_env(device="tpu", cache_dir=tmp_path / "cache", state_dir=tmp_path / "state")
    proc = run_cli("producer", ["run", "sharegpt", "--model", "tiny-qwen3.5", "--limit", "2", "--output",
                                str(tmp_path / "out")], env, timeout_s=120)
    assert proc.returncode == 2 and "HSX_DEVICE='tpu'" in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
