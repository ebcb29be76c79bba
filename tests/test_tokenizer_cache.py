"""The per-process tokenizer cache of the planner (``producer.tokenising.shared_tokenizer``): one load per
model directory, file contents and chat template; a changed file loads the tokenizer again.

Real parts: the real Qwen3 tokenizer files of ``tiny-qwen3.5`` (copied into a directory of the test's
own, so that the test can change them), loaded by transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from hsx.models import load_tokenizer, resolve_model_path
from producer.tokenising import TOKENIZER_CACHE_SIZE, TokeniserSpec, shared_tokenizer

TEXT = "Hello <|im_end|> wörld\n\n  tokens 12345"


@pytest.fixture
def model_dir(tiny_cache, tmp_path) -> Path:
    """A copy of the tiny model's directory (its tokenizer files and config) that the test may change."""
    src = Path(resolve_model_path("tiny-qwen3.5", tiny_cache))
    dest = tmp_path / "model"
    dest.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy2(f, dest / f.name)
    return dest


def _spec(model: str, cache: Path, chat_template: str | None = None) -> TokeniserSpec:
    return TokeniserSpec(model=model, cache_dir=str(cache), trust_remote_code=False, max_length=512,
                         enable_thinking=None, over_length="truncate", special_tokens_in_content="text",
                         allow_text=False, chat_template=chat_template)


def test_builds_of_the_same_files_share_one_tokenizer_that_encodes_as_a_fresh_load(tiny_cache):
    a, chat_a = _spec("tiny-qwen3.5", tiny_cache).build()
    b, chat_b = _spec("tiny-qwen3.5", tiny_cache).build()
    assert a is b and chat_a is not chat_b
    fresh = load_tokenizer("tiny-qwen3.5", tiny_cache)
    assert fresh is not a and type(fresh) is type(a) and len(fresh) == len(a)
    assert a.encode(TEXT, add_special_tokens=False) == fresh.encode(TEXT, add_special_tokens=False)
    assert a.chat_template == fresh.chat_template
    assert chat_a.template_sha256 == chat_b.template_sha256


def test_another_chat_template_is_another_tokenizer_and_the_shared_one_keeps_its_own(tiny_cache):
    plain, _ = _spec("tiny-qwen3.5", tiny_cache).build()
    own = plain.chat_template
    template = own.replace("<|im_start|>", "<|im_start|>", 1) + "{# another template #}"
    other, chat = _spec("tiny-qwen3.5", tiny_cache, chat_template=template).build()
    assert other is not plain and other.chat_template == template and plain.chat_template == own
    assert _spec("tiny-qwen3.5", tiny_cache, chat_template=template).build()[0] is other
    assert _spec("tiny-qwen3.5", tiny_cache).build()[0] is plain


def test_a_changed_tokenizer_file_loads_the_tokenizer_again(model_dir, tiny_cache):
    first = shared_tokenizer(str(model_dir), tiny_cache)
    assert shared_tokenizer(str(model_dir), tiny_cache) is first
    # rewritten in place, the same size: its chat template changed by one character
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    assert "You are provided" in config["chat_template"] and "PROVIDED" not in config["chat_template"]
    config["chat_template"] = config["chat_template"].replace("You are provided", "You are PROVIDED")
    text = json.dumps(config, indent=2, ensure_ascii=False)
    before = path.stat()
    assert len(text.encode()) == before.st_size
    with open(path, "r+", encoding="utf-8") as f:
        f.write(text)
        f.truncate()
    assert path.stat().st_ino == before.st_ino
    second = shared_tokenizer(str(model_dir), tiny_cache)
    assert second is not first and "You are PROVIDED" in second.chat_template
    assert "PROVIDED" not in first.chat_template
    assert shared_tokenizer(str(model_dir), tiny_cache) is second
    # a file added beside them (the tokenizer does not read it; the key does not know which files it reads)
    (model_dir / "notes.txt").write_text("x")
    assert shared_tokenizer(str(model_dir), tiny_cache) is not second
    # a file replaced by another (a new inode), then the directory copied elsewhere: loaded again each time
    third = shared_tokenizer(str(model_dir), tiny_cache)
    tmp = model_dir / "tokenizer_config.json.new"
    config["chat_template"] = config["chat_template"].replace("You are PROVIDED", "You are GIVEN")
    tmp.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    os.replace(tmp, path)
    fourth = shared_tokenizer(str(model_dir), tiny_cache)
    assert fourth is not third and "You are GIVEN" in fourth.chat_template
    moved = model_dir.parent / "moved"
    shutil.copytree(model_dir, moved)
    assert shared_tokenizer(str(moved), tiny_cache) is not fourth


def test_remote_code_and_more_than_the_limit_are_not_kept(model_dir, tiny_cache, monkeypatch):
    from producer import tokenising

    assert tokenising.TOKENIZER_CACHE_SIZE == TOKENIZER_CACHE_SIZE >= 2
    assert shared_tokenizer(str(model_dir), tiny_cache, trust_remote_code=True) is not \
        shared_tokenizer(str(model_dir), tiny_cache, trust_remote_code=True)
    monkeypatch.setattr(tokenising, "TOKENIZER_CACHE_SIZE", 1)  # the rule at any size, with 3 loads, not 6
    first = shared_tokenizer(str(model_dir), tiny_cache)
    other = shared_tokenizer(str(model_dir), tiny_cache, chat_template="{# another template #}")
    assert len(tokenising._TOKENIZERS) == 1 and shared_tokenizer(str(model_dir), tiny_cache) is not first
    assert other.chat_template == "{# another template #}"
