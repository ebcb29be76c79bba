"""A store URL is parsed once, by one set of rules (``hsx/storeurl.py``): what ``open_store`` opens,
``hsx.access`` compares and the S3 backend builds are the same :class:`StoreURL`."""

from __future__ import annotations

import os

import pytest

from hsx.access import normalise
from hsx.errors import BadConfig
from hsx.storeurl import StoreURL, parse_store_url


@pytest.mark.parametrize("url, expected", [
    ("s3://bucket", StoreURL("s3", bucket="bucket")),
    ("s3://bucket/", StoreURL("s3", bucket="bucket")),
    ("S3://bucket/runs/x/", StoreURL("s3", bucket="bucket", prefix="runs/x")),
    ("file:///data/out", StoreURL("local", path="/data/out")),
    ("file://localhost/data/my%20out", StoreURL("local", path="/data/my out")),
    ("/data/out/../out2", StoreURL("local", path="/data/out2")),
])
def test_each_accepted_form_is_one_typed_address(url, expected):
    assert parse_store_url(url) == expected
    assert parse_store_url(f"  {url} ") == expected, "surrounding blanks are dropped"


def test_a_relative_or_home_path_is_made_absolute_without_touching_the_filesystem(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert parse_store_url("out").path == str(tmp_path / "out") and not (tmp_path / "out").exists()
    assert parse_store_url("~/runs").path == str(tmp_path / "home" / "runs")


@pytest.mark.parametrize("url, words", [
    ("", "is empty"),
    ("   ", "is empty"),
    ("s3://key:secret@bucket/p", "carries credentials"),
    ("s3://", "is not s3://BUCKET"),
    ("s3://bucket/p?x=1", "is not s3://BUCKET"),
    ("s3://bucket/a//b", "bad prefix"),
    ("s3://bucket/a/../b", "bad prefix"),
    ("s3://bucket/./b", "bad prefix"),
    ("file://otherhost/data", "not a local file URL"),
    ("http://example.com/runs", "unsupported scheme 'http'"),
    ("s3:/bucket", "one slash"),
])
def test_every_caller_refuses_the_same_urls_with_the_rule_and_the_forms(url, words):
    """parse_store_url, normalise (the workers' allow-list) and open_store refuse alike."""
    from hsx.store import open_store

    for parse in (parse_store_url, normalise, lambda u: open_store(u, create=False)):
        with pytest.raises(BadConfig, match=words.replace("?", r"\?")):
            parse(url)


def test_a_refused_url_never_shows_its_secret():
    with pytest.raises(BadConfig) as err:
        parse_store_url("s3://key:hunter2@bucket")
    assert "hunter2" not in str(err.value)


def test_resolved_follows_links_and_contains_compares_whole_segments(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    link = parse_store_url(str(tmp_path / "link")).resolved()
    assert link == parse_store_url(str(tmp_path / "real")) == normalise(f"file://{tmp_path}/link")
    assert link.contains(normalise(str(tmp_path / "real" / "run1")))
    assert not link.contains(normalise(str(tmp_path / "real2")))
    runs = parse_store_url("s3://b/runs")
    assert runs.contains(parse_store_url("s3://b/runs/r1")) and not runs.contains(parse_store_url("s3://b/runs2"))
    assert not runs.contains(parse_store_url("s3://other/runs/r1")) and not runs.contains(link)


def test_str_is_the_canonical_address():
    assert str(parse_store_url("s3://b/p/q/")) == "s3://b/p/q" and str(parse_store_url("s3://b")) == "s3://b"
    assert str(parse_store_url("file:///data/out")) == "/data/out"
