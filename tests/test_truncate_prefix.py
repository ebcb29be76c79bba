"""Specifications of producer.masks: truncation by prefix.

With ``over_length="truncate"``, a render far longer than ``max_length`` tokens can need is tokenised
only as far as a cut point before which it tokenises exactly as the whole render does, grown until
more than ``max_length`` tokens come out (module docstring, "Truncation by prefix"). The sample is
the one whole tokenisation then cutting gives: the same ids, loss mask, truncated flag, and the same
skip. Every test compares the two paths on the real Qwen3 tokenizer and template: the prefix path is
forced on every record by ``truncate_prefix_min_chars = 0``, the whole path by a huge one.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path

import numpy as np
import pytest
from tokenizers import normalizers
from transformers import AutoTokenizer

from hsx.errors import BadRecord
from producer.datasets import Conversation, SkipCounter, iter_conversations
from producer.masks import TRUNCATE_PREFIX_CHARS_PER_TOKEN, ChatTokeniser, _safe_cut, _safe_pair

QWEN3_TOKENIZER_DIR = str(Path(__file__).resolve().parents[1] / "hsx" / "assets" / "qwen3-tokenizer")
WHOLE = 1 << 60  # truncate_prefix_min_chars that no render reaches


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def chats(tok):
    """(whole, prefix) ChatTokenisers by (max_length, options), made once."""
    made: dict = {}

    def get(max_length: int, **options) -> tuple[ChatTokeniser, ChatTokeniser]:
        key = (max_length, tuple(sorted(options.items())))
        if key not in made:
            whole = ChatTokeniser(tok, max_length=max_length, **options)
            whole.truncate_prefix_min_chars = WHOLE
            prefix = ChatTokeniser(tok, max_length=max_length, **options)
            prefix.truncate_prefix_min_chars = 0
            made[key] = (whole, prefix)
        return made[key]

    return get


def _outcome(result) -> tuple:
    if isinstance(result, BadRecord):
        return ("skipped", result.record_id, result.reason, result.detail)
    return ("sample", result.record_id, result.input_ids.tolist(), result.loss_mask.tolist(), result.truncated,
            str(result.input_ids.dtype), str(result.loss_mask.dtype))


def _encode(chat: ChatTokeniser, conv: Conversation) -> tuple:
    try:
        return _outcome(chat.encode(conv))
    except BadRecord as err:
        return _outcome(err)


def _assert_same(chats, conv: Conversation, max_length: int, **options) -> tuple:
    """The prefix path gives the whole path's outcome, settled by the prefix (no fallback); returns it."""
    whole, prefix = chats(max_length, **options)
    fallbacks = prefix.prefix_fallbacks
    want = _encode(whole, conv)
    assert _encode(prefix, conv) == want, (conv.record_id, max_length, options)
    assert prefix.prefix_fallbacks == fallbacks, "the prefix did not settle the sample"
    return want


def _conv(rid: str, *turns, tools=None, unfinished=frozenset()) -> Conversation:
    return Conversation(rid, tuple({"role": r, "content": c} for r, c in turns), tools=tools,
                        unfinished_turns=frozenset(unfinished))


# Real records ----------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"enable_thinking": False}, {"special_tokens_in_content": "special"}],
                         ids=["default", "no-thinking", "special"])
def test_real_sharegpt_records_give_the_same_samples_by_prefix_one_by_one_and_batched(chats, options):
    """60 ShareGPT records at max_length 2 to 1000 (cuts in prompts, in replies, before the first
    reply: no_supervised_tokens), by encode and by encode_many: what whole tokenisation gives. With
    ``enable_thinking=False`` reply starts come from the prompt's token ids, tokenised by prefix too."""
    convs = list(iter_conversations("sharegpt", SkipCounter(), limit=60))
    kinds = set()
    for max_length in (2, 16, 64, 300, 1000):
        whole, prefix = chats(max_length, **options)
        want = [_encode(whole, c) for c in convs]
        assert [_encode(prefix, c) for c in convs] == want
        assert [_outcome(r) for r in prefix.encode_many(convs, chunk_records=16)] == want
        assert prefix.prefix_fallbacks == 0
        kinds.update(w[0] for w in want)
        if max_length == 16:  # two passes over the prefixes, one over the whole renders
            assert prefix.tokenised_chars < whole.tokenised_chars / 4
    assert kinds == {"sample", "skipped"}


# Adversarial records ---------------------------------------------------------------------------

RUNS = {
    "spaces": " " * 3000,
    "newlines": "\n" * 3000,
    "crlf": "\r\n" * 1500,
    "spaces-and-newlines": " \n  \n\t \n" * 400,
    "letters": "a" * 3000,
    "digits": "7" * 3000,
    "cjk": "中文字" * 1000,
    "cjk-punctuated": "中文，字。\n" * 500,
    "emoji": "😀🚀" * 1500,
    "punctuation": "!?.,;" * 600,
    "punctuation-then-newlines": ".\n\n" * 1000,
    "combining-marks": "e\u0301a\u0308" * 800,
    "hangul-jamo": "\u1100\u1161\u11a8" * 1000,
    "contractions": "'s're'LL'Ve" * 300,
    "mixed": "Hello, world! 123 ok\n  \tx = y + 2;  // 中文 😀\n" * 80,
}


@pytest.mark.parametrize("run", sorted(RUNS))
@pytest.mark.parametrize("where", ["user", "assistant"])
def test_long_runs_across_the_cut_give_the_same_samples(chats, run, where):
    """A run of spaces, newlines, letters, digits, CJK, emoji, punctuation, combining marks... in the
    user turn (the reply starts after the cut: no_supervised_tokens) or in the reply (cut inside the
    reply), with text before and after it, at max_lengths that put the cut before, inside and after
    the run: the whole path's sample or skip."""
    body = "Look at this: " + RUNS[run] + " and then more words 42 follow here."
    turns = [("system", "Be brief."), ("user", body if where == "user" else "Write it."),
             ("assistant", body if where == "assistant" else "Done, it is long."),
             ("user", "Again?"), ("assistant", "Yes " * 50)]
    seen = set()
    for max_length in (3, 9, 20, 33, 60, 130, 400, 1500, 8000):
        seen.add(_assert_same(chats, _conv(f"{run}-{where}", *turns), max_length)[0])
    assert "sample" in seen and (where == "assistant" or "skipped" in seen)


@pytest.mark.parametrize("options", [{}, {"special_tokens_in_content": "special"}, {"added_tokens_in_content": "text"}],
                         ids=["text", "special", "added-as-text"])
def test_special_token_strings_in_content_across_the_cut_give_the_same_samples(chats, options):
    """Content full of special-token and added-token strings (placeholders in ``text`` mode, tokens in
    ``special`` mode) before, across and after the cut, in the prompt and in the reply."""
    injected = "x <|im_end|>\n<|im_start|>assistant\n<think>y</think> <|endoftext|>z " * 150
    convs = [
        _conv("in-reply", ("user", "Quote it."), ("assistant", "Sure: " + injected)),
        _conv("in-prompt", ("user", injected), ("assistant", "Those are tokens.")),
        _conv("both", ("user", "a <|im_end|> b"), ("assistant", injected), ("user", injected),
              ("assistant", "end")),
    ]
    for conv in convs:
        for max_length in (4, 26, 140, 900):
            _assert_same(chats, conv, max_length, **options)


def test_a_cut_inside_a_reply_supervises_to_the_cut_and_a_reply_after_it_is_no_supervised_tokens(chats):
    """A long reply cut by max_length: truncated, the last token supervised. A prompt longer than
    max_length: the whole path's no_supervised_tokens skip, with its detail."""
    long_text = "The quick brown fox jumps over the lazy dog. " * 400
    inside = _assert_same(chats, _conv("inside", ("user", "Go."), ("assistant", long_text)), 64)
    assert inside[0] == "sample" and inside[4] and len(inside[2]) == 64 and inside[3][-1] == 1
    after = _assert_same(chats, _conv("after", ("user", long_text), ("assistant", "Short.")), 64)
    assert after[0] == "skipped" and after[2] == "no_supervised_tokens" and "after truncation" in after[3]


def test_tools_reasoning_and_unfinished_replies_give_the_same_samples(chats):
    """Tool definitions, a tool call, a long tool result, reasoning, consecutive replies and an
    unfinished reply (its end-of-turn token beyond the cut: tokenised whole, the same sample)."""
    tool = {"type": "function", "function": {"name": "read", "description": "Read a file " * 30,
                                              "parameters": {"type": "object", "properties": {}}}}
    call = [{"type": "function", "function": {"name": "read", "arguments": {"path": "/x"}}}]
    tools_conv = Conversation("tools", (
        {"role": "user", "content": "Read /x."},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": "line of the file\n" * 300},
        {"role": "assistant", "content": "It says: " + "line of the file, " * 100,
         "reasoning_content": "think " * 200},
    ), tools=(tool,))
    consecutive = _conv("consecutive", ("user", "Two parts."), ("assistant", "First " * 100),
                        ("assistant", "Second " * 100))
    for max_length in (5, 30, 120, 260, 700, 2000):
        _assert_same(chats, tools_conv, max_length)
        _assert_same(chats, tools_conv, max_length, enable_thinking=False)
        _assert_same(chats, consecutive, max_length)
        _assert_same(chats, consecutive, max_length, enable_thinking=False)
    unfinished = _conv("unfinished", ("user", "Count."), ("assistant", "one two three " * 300), unfinished={1})
    whole, prefix = chats(50)
    assert _encode(prefix, unfinished) == _encode(whole, unfinished)
    short = _conv("unfinished-short", ("user", "Count " * 300), ("assistant", "one two"), ("user", "more"),
                  ("assistant", "three four " * 200), unfinished={1})
    _assert_same(chats, short, 700)  # the unfinished reply ends before the cut: settled by the prefix


# The cut points ---------------------------------------------------------------------------------


def test_every_cut_point_the_rules_accept_tokenises_like_the_whole_text(tok):
    """Random texts over letters, digits, whitespace, punctuation, CJK, emoji, combining marks,
    contractions and special-token strings: at each cut ``_safe_pair`` accepts (no added-token
    string across it), the prefix's tokens and end offsets are the whole text's first ones, and
    the whole text has more. ``_safe_cut`` finds the first such cut."""
    backend = tok.backend_tokenizer
    added = tuple(tok.get_added_vocab())
    alphabet = (list("aZé'sSrevlLmd0123456789 \t\n\r\x0b!.,\"<>|_-") +
                ["中", "，", "。", "가", "\u1161", "\u11a8", "e\u0301", "\u0301", "😀", "ſ", "١", "²", "\u00a0",
                 "\u2028", "\x85", "１", "Ａ", "か\u3099", "<|im_end|>", "<think>", "<|im_start|>", "<|im_end", "\u212b"])
    rng = random.Random(1)
    checked = 0
    for _ in range(600):
        text = "".join(rng.choice(alphabet) * rng.choice([1, 1, 2, 5]) for _ in range(rng.randint(2, 30)))
        whole = backend.encode(text, add_special_tokens=False)
        first = _safe_cut(text, 0, added)
        for cut in range(1, len(text)):
            ok = _safe_pair(text[cut - 1], text[cut]) and not any(
                0 <= text.find(s, max(0, cut - len(s) + 1), cut + len(s) - 1) < cut for s in added)
            if cut < first:
                assert not ok
            if not ok:
                continue
            first = min(first, cut)
            part = backend.encode(text[:cut], add_special_tokens=False)
            n = len(part.ids)
            assert part.ids == whole.ids[:n] and part.offsets == whole.offsets[:n], (text, cut)
            assert len(whole.ids) > n and whole.offsets[n][0] >= cut
            checked += 1
    assert checked > 3000


# Large records ----------------------------------------------------------------------------------


def test_a_large_record_is_truncated_from_a_small_prefix_of_its_render(tok):
    """A 4 MB conversation (real ShareGPT text) with --max-length 4096: a few tens of thousands of
    characters are tokenised, not its 4 million (whole, that took 80 s and 5.4 GB at 30 MB), and the
    sample is the first 4096 tokens of the whole render and their mask, as ``tokenizer(render)``
    gives them. The same record in a batch of short ones, by encode_many. Normal records are far
    below the threshold (64 characters per token of max_length)."""
    convs = list(iter_conversations("sharegpt", SkipCounter(), limit=30))
    text = "\n\n".join(m["content"] for c in convs for m in c.messages)
    big = (text * (4_000_000 // len(text) + 1))[:4_000_000]
    conv = _conv("big", ("user", "Write a lot."), ("assistant", big))
    chat = ChatTokeniser(tok, max_length=4096)
    assert chat.truncate_prefix_min_chars == TRUNCATE_PREFIX_CHARS_PER_TOKEN * 4096
    sample = chat.encode(conv)
    assert chat.tokenised_chars < 100_000 and chat.prefix_fallbacks == 0
    assert sample.truncated and sample.num_tokens == 4096
    render = tok.apply_chat_template(list(conv.messages), tokenize=False)
    assert len(render) > 4_000_000
    first = tok(render[:200_000], add_special_tokens=False)["input_ids"][:4096]  # ordinary text: ~50,000 chars
    assert sample.input_ids.tolist() == first
    reply_start = tok(tok.apply_chat_template(list(conv.messages[:1]), tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)["input_ids"]
    assert sample.loss_mask.tolist() == [0] * len(reply_start) + [1] * (4096 - len(reply_start))

    chat.tokenised_chars = 0
    short = convs[:5]
    got = list(chat.encode_many([*short[:2], conv, *short[2:]], chunk_records=3))
    assert _outcome(got[2]) == _outcome(sample)
    assert [_outcome(g) for g in got[:2] + got[3:]] == [_outcome(chat.encode(c)) for c in short]
    assert chat.tokenised_chars < 200_000


def test_drop_long_and_unknown_tokenizers_keep_whole_tokenisation(tok):
    """Only ``over_length="truncate"`` and a tokenizer whose cut points are known take the prefix:
    with another normalizer (here lowercasing) the render is tokenised whole, as before."""
    conv = _conv("long", ("user", "Go."), ("assistant", "Some Words " * 20_000))
    other = copy.deepcopy(tok)
    other.backend_tokenizer.normalizer = normalizers.Lowercase()
    chat = ChatTokeniser(other, max_length=64)
    chat.truncate_prefix_min_chars = 0
    sample = chat.encode(conv)
    assert sample.truncated and chat.tokenised_chars > 200_000
    drop = ChatTokeniser(tok, max_length=64, over_length="drop")
    drop.truncate_prefix_min_chars = 0
    with pytest.raises(BadRecord) as info:
        drop.encode(conv)
    assert info.value.reason == "too_long"
    known = ChatTokeniser(tok, max_length=64)
    known.truncate_prefix_min_chars = 0
    assert known.encode(conv).truncated and known.tokenised_chars < 5_000
