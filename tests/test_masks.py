"""Specifications of producer.masks: the assistant-only loss mask on the real Qwen3 tokenizer and template."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from core.errors import BadRecord
from producer.datasets import Conversation, SkipCounter, iter_conversations
from producer.masks import ChatTokeniser, TokenisedSample

QWEN3_TOKENIZER_DIR = "/work/shared/data/tokenizers/qwen3"
IM_END = 151645
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    return AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)


@pytest.fixture(scope="module")
def chat(qwen3_tokenizer):
    return ChatTokeniser(qwen3_tokenizer, max_length=1 << 20)


def _conv(rid: str, *turns: tuple[str, str]) -> Conversation:
    return Conversation(rid, tuple({"role": r, "content": c} for r, c in turns))


def _spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def _span_texts(tok, sample: TokenisedSample) -> list[str]:
    return [tok.decode(sample.input_ids[a:b].tolist()) for a, b in _spans(sample.loss_mask)]


SYSTEM_3_TURNS = [
    ("system", "You are terse."),
    ("user", "What is 2+2?"),
    ("assistant", "4."),
    ("user", "And doubled?"),
    ("assistant", "It is 8, because 4 * 2 = 8."),
    ("user", "Thanks!"),
    ("assistant", "You're welcome \u2014 anything else?"),
]


def test_the_end_of_turn_token_is_found_by_probing_the_template(chat, qwen3_tokenizer):
    """Qwen3 closes a reply with <|im_end|> (151645); the template hash is the sha256 of its text."""
    assert chat.end_of_turn_ids == frozenset({IM_END})
    template = qwen3_tokenizer.get_chat_template()
    assert chat.template_sha256 == hashlib.sha256(template.encode()).hexdigest()


def test_the_mask_covers_exactly_each_assistant_reply_and_its_im_end(chat, qwen3_tokenizer):
    """Supervised spans decode to each reply + <|im_end|> (the final one after its empty think block)."""
    sample = chat.encode(_conv("c", *SYSTEM_3_TURNS))
    assert sample.input_ids.dtype == np.int32 and sample.loss_mask.dtype == np.uint8
    assert not sample.truncated
    replies = [c for r, c in SYSTEM_3_TURNS if r == "assistant"]
    assert _span_texts(qwen3_tokenizer, sample) == [
        replies[0] + "<|im_end|>",
        replies[1] + "<|im_end|>",
        EMPTY_THINK + replies[2] + "<|im_end|>",
    ]
    # Everything else (system, user turns, headers) is unsupervised: the ids outside the spans
    # decode to the render with the supervised text cut out.
    unsup = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    assert unsup == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n\n<|im_start|>user\nAnd doubled?<|im_end|>\n<|im_start|>assistant\n\n"
        "<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_sharegpt_and_openai_forms_of_one_conversation_give_identical_ids_and_masks(tmp_path, chat):
    """The record form does not change the sample: same ids, same mask, same record id."""
    sharegpt_role = {"system": "system", "user": "human", "assistant": "gpt"}
    sg = {"id": "same", "conversations": [{"from": sharegpt_role[r], "value": c} for r, c in SYSTEM_3_TURNS]}
    oa = {"id": "same", "messages": [
        {"role": r, "content": [{"type": "text", "text": c[:3]}, {"type": "text", "text": c[3:]}]}
        for r, c in SYSTEM_3_TURNS
    ]}
    (tmp_path / "sg.jsonl").write_text(json.dumps(sg) + "\n")
    (tmp_path / "oa.jsonl").write_text(json.dumps(oa) + "\n")
    (a,) = iter_conversations(str(tmp_path / "sg.jsonl"), SkipCounter())
    (b,) = iter_conversations(str(tmp_path / "oa.jsonl"), SkipCounter())
    sa, sb = chat.encode(a), chat.encode(b)
    assert sa.record_id == sb.record_id == "same"
    assert np.array_equal(sa.input_ids, sb.input_ids)
    assert np.array_equal(sa.loss_mask, sb.loss_mask)
    assert sa.loss_mask.sum() > 10


def test_a_reply_starting_with_a_newline_or_without_a_space_has_its_first_token_supervised(chat, qwen3_tokenizer):
    """The first reply token is supervised (even when BPE merges it with the header newline); the header is not."""
    conv = _conv("nl", ("user", "Hi"), ("assistant", "\nHello there"), ("user", "Again"),
                 ("assistant", "World!"), ("user", "Bye"), ("assistant", "Ciao"))
    sample = chat.encode(conv)
    toks = [qwen3_tokenizer.decode([t]) for t in sample.input_ids.tolist()]
    spans = _spans(sample.loss_mask)
    assert len(spans) == 3
    (a0, _), (a1, _), _ = spans
    # "assistant\n" + "\nHello": the pre-tokeniser makes one "\n\n" token across the boundary.
    assert toks[a0 - 2: a0 + 2] == ["<|im_start|>", "assistant", "\n\n", "Hello"]
    # "assistant\n" + "World!": the reply's first token follows the header's own "\n" token.
    assert toks[a1 - 3: a1 + 1] == ["<|im_start|>", "assistant", "\n", "World"]
    assert sample.loss_mask[a1 - 1] == 0


def test_truncation_at_max_length_keeps_the_mask_aligned(qwen3_tokenizer, chat):
    """The truncated sample is the untruncated one cut at max_length: ids[:L] and mask[:L]."""
    full = chat.encode(_conv("c", *SYSTEM_3_TURNS))
    seen_cut_inside_reply = False
    for length in range(8, full.num_tokens, 5):
        try:
            cut = ChatTokeniser(qwen3_tokenizer, max_length=length).encode(_conv("c", *SYSTEM_3_TURNS))
        except BadRecord as err:
            assert err.reason == "no_supervised_tokens"
            continue
        assert cut.truncated and cut.num_tokens == length
        assert np.array_equal(cut.input_ids, full.input_ids[:length])
        assert np.array_equal(cut.loss_mask, full.loss_mask[:length])
        seen_cut_inside_reply |= bool(cut.loss_mask[-1])
    assert seen_cut_inside_reply
    same = ChatTokeniser(qwen3_tokenizer, max_length=full.num_tokens).encode(_conv("c", *SYSTEM_3_TURNS))
    assert not same.truncated and np.array_equal(same.loss_mask, full.loss_mask)


def test_a_record_with_too_few_supervised_tokens_after_truncation_is_skipped(qwen3_tokenizer, chat):
    """One supervised token left by truncation is not enough (DFlash needs two consecutive): no_supervised_tokens."""
    conv = _conv("short", ("user", "A long question " * 20), ("assistant", "Yes, indeed."))
    first = _spans(chat.encode(conv).loss_mask)[0][0]
    with pytest.raises(BadRecord) as info:
        ChatTokeniser(qwen3_tokenizer, max_length=first + 1).encode(conv)
    assert info.value.reason == "no_supervised_tokens" and info.value.record_id == "short"
    ok = ChatTokeniser(qwen3_tokenizer, max_length=first + 2).encode(conv)
    assert ok.loss_mask.sum() == 2 and ok.truncated


def test_no_real_sharegpt_record_gets_an_all_zero_mask(qwen3_tokenizer):
    """On 200 ShareGPT records (template without generation markers) every sample has >= 2 consecutive
    supervised tokens, one span per assistant turn, and every span decodes to text of an assistant turn."""
    chat = ChatTokeniser(qwen3_tokenizer, max_length=2048)
    convs = list(iter_conversations("sharegpt", SkipCounter(), limit=200))
    assert len(convs) == 200
    results = list(chat.encode_many(convs))
    unlimited = ChatTokeniser(qwen3_tokenizer, max_length=1 << 20)
    n_ok = n_truncated = 0
    for conv, res in zip(convs, results):
        if isinstance(res, BadRecord):
            # Only a prompt longer than max_length may leave nothing to supervise.
            assert res.reason == "no_supervised_tokens", res
            first_start = _spans(unlimited.encode(conv).loss_mask)[0][0]
            assert first_start >= chat.max_length - 1, (res, first_start)
            continue
        n_ok += 1
        n_truncated += res.truncated
        assert np.any(res.loss_mask[1:] & res.loss_mask[:-1]), conv.record_id
        replies = [m["content"] for m in conv.messages if m["role"] == "assistant"]
        texts = _span_texts(qwen3_tokenizer, res)
        if not res.truncated:
            assert len(texts) == len(replies), conv.record_id
        for text in texts:
            body = text.removesuffix("<|im_end|>").removeprefix(EMPTY_THINK).rstrip("\ufffd").strip()
            assert body and any(body in r for r in replies), (conv.record_id, text[:200])
    assert n_ok >= 180 and n_truncated >= 20  # both kinds of sample were really seen


def test_encode_many_gives_what_encode_gives(chat):
    """The batched path (parallel tokenisation) returns the same samples and the same errors as encode."""
    convs = list(iter_conversations("sharegpt", SkipCounter(), limit=40))
    convs.append(_conv("broken", ("user", None), ("assistant", "A")))  # type: ignore[arg-type]
    batched = list(chat.encode_many(convs, chunk_records=16))
    for conv, got in zip(convs, batched):
        try:
            want = chat.encode(conv)
        except BadRecord as err:
            assert isinstance(got, BadRecord) and got.reason == err.reason
            continue
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.loss_mask, want.loss_mask)


def test_a_template_error_becomes_a_bad_record(chat):
    """Content None makes the Qwen3 template raise: BadRecord template_error with the exception text."""
    with pytest.raises(BadRecord) as info:
        chat.encode(_conv("none", ("user", None), ("assistant", "A")))  # type: ignore[arg-type]
    assert info.value.reason == "template_error" and info.value.detail


def test_enable_thinking_false_supervises_replies_but_not_the_prompted_think_block(qwen3_tokenizer):
    """With enable_thinking=False the empty think block is in the prompt, so only the reply is supervised."""
    chat = ChatTokeniser(qwen3_tokenizer, max_length=1 << 20, enable_thinking=False)
    sample = chat.encode(_conv("c", *SYSTEM_3_TURNS))
    replies = [c for r, c in SYSTEM_3_TURNS if r == "assistant"]
    assert _span_texts(qwen3_tokenizer, sample) == [r + "<|im_end|>" for r in replies]


def test_consecutive_assistant_turns_are_each_supervised_once(chat, qwen3_tokenizer):
    """Two replies in a row (the template renders the first differently when it is last) get one span each."""
    conv = _conv("aa", ("user", "Q"), ("assistant", "First part."), ("assistant", "Second part."),
                 ("user", "Q2"), ("assistant", "Third."))
    sample = chat.encode(conv)
    assert _span_texts(qwen3_tokenizer, sample) == [
        "First part.<|im_end|>", "Second part.<|im_end|>", EMPTY_THINK + "Third.<|im_end|>",
    ]


def test_tool_calls_are_supervised_and_tool_results_are_not(chat, qwen3_tokenizer):
    """An assistant tool call is a reply (supervised); the tool's result is input (not supervised)."""
    call = [{"type": "function", "function": {"name": "now", "arguments": {"tz": "UTC"}}}]
    conv = Conversation("tools", (
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": call},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "Noon."},
    ))
    texts = _span_texts(qwen3_tokenizer, chat.encode(conv))
    assert texts == [
        '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call><|im_end|>',
        EMPTY_THINK + "Noon.<|im_end|>",
    ]


def test_the_offset_shortcut_and_the_token_id_comparison_agree_on_real_records(qwen3_tokenizer, chat):
    """Reading the reply start from the offset mapping gives the same mask as comparing prefix token ids."""
    by_ids = ChatTokeniser(qwen3_tokenizer, max_length=1 << 20)
    by_ids._backend = None  # no offsets: every prefix is tokenised and compared on ids
    convs = list(iter_conversations("sharegpt", SkipCounter(), limit=60))
    for conv in convs:
        a, b = chat.encode(conv), by_ids.encode(conv)
        assert np.array_equal(a.input_ids, b.input_ids), conv.record_id
        assert np.array_equal(a.loss_mask, b.loss_mask), conv.record_id


def test_reasoning_is_supervised_in_the_final_reply_and_dropped_from_earlier_ones(chat, qwen3_tokenizer):
    """The Qwen3 template keeps reasoning_content only after the last user turn; what it renders is supervised."""
    conv = Conversation("think", (
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
    ))
    sample = chat.encode(conv)
    assert _span_texts(qwen3_tokenizer, sample) == ["A1<|im_end|>", "<think>\nr2\n</think>\n\nA2<|im_end|>"]
    assert "r1" not in qwen3_tokenizer.decode(sample.input_ids.tolist())
