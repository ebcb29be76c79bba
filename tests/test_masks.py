"""Specifications of producer.masks: the assistant-only loss mask on the real Qwen3 tokenizer and template."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from hsx.errors import BadRecord
from producer.datasets import Conversation, PretokenisedRecord, SkipCounter, TextRecord, iter_conversations
from producer.masks import ChatTokeniser, TokenisedSample
from producer.planner import PlanOptions, tokenise_dataset

QWEN3_TOKENIZER_DIR = str(Path(__file__).resolve().parents[1] / "hsx" / "assets" / "qwen3-tokenizer")
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


# --------------------------------------------------------------------------------------------
# Conversation shapes (issue 3): other templates, tools, reasoning, other record forms, length policy

#: A Llama-3.1-shaped template on Qwen3 vocabulary: ``<|object_ref_start|>`` stands in for
#: <|begin_of_text|>, ``<|box_start|>``/``<|box_end|>`` for <|start_header_id|>/<|end_header_id|>
#: and ``<|endoftext|>`` for <|eot_id|>. Like Llama 3.1 it always writes a system header, trims
#: contents, and (like several templates) refuses a system message that is not first. The
#: ``{% generation %}`` markers are removed for the tokeniser under test and kept for transformers'
#: own assistant mask, the reference.
LLAMA_LIKE_WITH_MARKERS = (
    "{{- '<|object_ref_start|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|box_start|>system<|box_end|>\\n\\nCutting Knowledge Date: December 2023\\n\\n' + system + '<|endoftext|>' }}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{ raise_exception('system message must be first, found one at turn ' ~ loop.index) }}{%- endif %}"
    "{{- '<|box_start|>' + m.role + '<|box_end|>\\n\\n' }}"
    "{%- if m.role == 'assistant' %}{% generation %}{{- m.content | trim + '<|endoftext|>' }}{% endgeneration %}"
    "{%- else %}{{- m.content | trim + '<|endoftext|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|box_start|>assistant<|box_end|>\\n\\n' }}{%- endif %}"
)
LLAMA_LIKE = LLAMA_LIKE_WITH_MARKERS.replace("{% generation %}", "").replace("{% endgeneration %}", "")
ENDOFTEXT = 151643


@pytest.fixture(scope="module")
def llama_tokenizer():
    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
    tok.chat_template = LLAMA_LIKE
    return tok


@pytest.fixture(scope="module")
def llama_chat(llama_tokenizer):
    return ChatTokeniser(llama_tokenizer, max_length=1 << 20)


def _record_forms(tmp_path: Path, turns: list[tuple[str, str]]) -> tuple[Conversation, Conversation]:
    """One conversation read from a ShareGPT file and from an OpenAI file (content split in parts)."""
    sharegpt_role = {"system": "system", "user": "human", "assistant": "gpt"}
    sg = {"id": "same", "conversations": [{"from": sharegpt_role[r], "value": c} for r, c in turns]}
    oa = {"id": "same", "messages": [{"role": r, "content": [{"type": "text", "text": c[:3]}, {"type": "text", "text": c[3:]}]}
                                     for r, c in turns]}
    (tmp_path / "sg.jsonl").write_text(json.dumps(sg) + "\n")
    (tmp_path / "oa.jsonl").write_text(json.dumps(oa) + "\n")
    (a,) = iter_conversations(str(tmp_path / "sg.jsonl"), SkipCounter())
    (b,) = iter_conversations(str(tmp_path / "oa.jsonl"), SkipCounter())
    return a, b


def test_a_llama_shaped_template_masks_exactly_each_reply_and_its_eot_in_both_record_forms(tmp_path, llama_tokenizer, llama_chat):
    """System + three turns on a Llama-3.1-shaped template: ShareGPT and OpenAI forms give the same ids and
    mask, the spans are exactly each (trimmed) reply + eot, and the mask equals transformers' own
    ``{% generation %}`` mask of the same template with markers."""
    a, b = _record_forms(tmp_path, SYSTEM_3_TURNS)
    sa, sb = llama_chat.encode(a), llama_chat.encode(b)
    assert llama_chat.end_of_turn_ids == frozenset({ENDOFTEXT, IM_END})  # probed eot + eos
    assert np.array_equal(sa.input_ids, sb.input_ids) and np.array_equal(sa.loss_mask, sb.loss_mask)
    replies = [c for r, c in SYSTEM_3_TURNS if r == "assistant"]
    assert _span_texts(llama_tokenizer, sa) == [r + "<|endoftext|>" for r in replies]
    unsup = llama_tokenizer.decode(sa.input_ids[sa.loss_mask == 0].tolist())
    assert unsup == (
        "<|object_ref_start|><|box_start|>system<|box_end|>\n\nCutting Knowledge Date: December 2023\n\n"
        "You are terse.<|endoftext|><|box_start|>user<|box_end|>\n\nWhat is 2+2?<|endoftext|>"
        "<|box_start|>assistant<|box_end|>\n\n<|box_start|>user<|box_end|>\n\nAnd doubled?<|endoftext|>"
        "<|box_start|>assistant<|box_end|>\n\n<|box_start|>user<|box_end|>\n\nThanks!<|endoftext|>"
        "<|box_start|>assistant<|box_end|>\n\n"
    )
    reference = llama_tokenizer.apply_chat_template(
        list(a.messages), chat_template=LLAMA_LIKE_WITH_MARKERS, tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True)
    assert list(reference["input_ids"]) == sa.input_ids.tolist()
    assert list(reference["assistant_masks"]) == sa.loss_mask.tolist()
    by_ids = ChatTokeniser(llama_tokenizer, max_length=1 << 20)
    by_ids._backend = None  # prefixes tokenised and compared on ids instead of the offset shortcut
    assert by_ids.encode(a).loss_mask.tolist() == sa.loss_mask.tolist()


def test_a_llama_shaped_reply_has_its_first_content_token_supervised_and_never_the_header(llama_tokenizer, llama_chat):
    """A reply that starts with a newline (trimmed by the template) or without a space: first token
    supervised, the header's ``\\n\\n`` not."""
    conv = _conv("nl", ("user", "Hi"), ("assistant", "\nHello there"), ("user", "Again"), ("assistant", "World!"))
    sample = llama_chat.encode(conv)
    toks = [llama_tokenizer.decode([t]) for t in sample.input_ids.tolist()]
    (a0, _), (a1, _) = _spans(sample.loss_mask)
    assert toks[a0 - 4: a0 + 1] == ["<|box_start|>", "assistant", "<|box_end|>", "\n\n", "Hello"]
    assert toks[a1 - 4: a1 + 1] == ["<|box_start|>", "assistant", "<|box_end|>", "\n\n", "World"]


def test_without_generation_markers_transformers_masks_nothing_and_ours_masks_the_replies(qwen3_tokenizer, chat):
    """The Qwen3 template has no ``{% generation %}``: transformers' assistant mask is all zeros; ours is not."""
    assert "{% generation %}" not in qwen3_tokenizer.get_chat_template()
    conv = _conv("c", *SYSTEM_3_TURNS)
    theirs = qwen3_tokenizer.apply_chat_template(list(conv.messages), tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
    ours = chat.encode(conv)
    assert list(theirs["input_ids"]) == ours.input_ids.tolist()
    assert not any(theirs["assistant_masks"])
    assert len(_spans(ours.loss_mask)) == 3


def test_a_conversation_the_template_cannot_render_is_skipped_with_the_template_reason(llama_chat):
    """The Llama-shaped template raises for a system message after the first turn: template_error with its
    message, in encode and in encode_many (the neighbours are unaffected)."""
    bad = _conv("late-system", ("user", "Hi"), ("assistant", "Hello."), ("system", "Be brief."),
                ("user", "Again"), ("assistant", "Hello again."))
    with pytest.raises(BadRecord) as info:
        llama_chat.encode(bad)
    assert info.value.reason == "template_error" and info.value.record_id == "late-system"
    assert "system message must be first, found one at turn 3" in info.value.detail
    good = _conv("ok", ("user", "Hi"), ("assistant", "Hello."))
    out = list(llama_chat.encode_many([good, bad, good]))
    assert [type(x).__name__ for x in out] == ["TokenisedSample", "BadRecord", "TokenisedSample"]
    assert out[1].reason == "template_error"


# Tools --------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_openai_tool_calls_are_supervised_and_tool_results_and_definitions_are_not(tmp_path, qwen3_tokenizer, chat):
    """An OpenAI record with ``tools``, a tool call (string arguments) and two tool results, read from a file:
    the tool definitions are rendered in the system turn and not supervised, the call is, the results are not."""
    rec = {"id": "weather", "tools": [WEATHER_TOOL], "messages": [
        {"role": "system", "content": "You are a weather bot."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "{\"temp_c\": 21}"},
        {"role": "tool", "tool_call_id": "c2", "content": "{\"temp_c\": 27}"},
        {"role": "assistant", "content": "Paris 21 C, Rome 27 C."},
    ]}
    (tmp_path / "t.jsonl").write_text(json.dumps(rec) + "\n")
    (conv,) = iter_conversations(str(tmp_path / "t.jsonl"), SkipCounter())
    assert conv.tools == (WEATHER_TOOL,)
    sample = chat.encode(conv)
    assert _span_texts(qwen3_tokenizer, sample) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        EMPTY_THINK + "Paris 21 C, Rome 27 C.<|im_end|>",
    ]
    row = qwen3_tokenizer.decode(sample.input_ids.tolist())
    unsup = qwen3_tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    assert row.startswith("<|im_start|>system\nYou are a weather bot.\n\n# Tools\n")
    assert json.dumps(WEATHER_TOOL) in unsup  # the definitions reached the template, unsupervised
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 21}\n</tool_response>\n<tool_response>\n{"temp_c": 27}\n</tool_response><|im_end|>' in unsup


# Reasoning ----------------------------------------------------------------------------------


def test_inline_think_blocks_and_reasoning_content_fields_give_the_same_sample(chat, qwen3_tokenizer):
    """``<think>r</think>`` inside the content and a ``reasoning_content`` field render alike; after the last
    user turn every reply's reasoning is supervised (a tool loop), before it the template drops it."""
    def conv(inline: bool) -> Conversation:
        def reply(reasoning, content, **kw):
            if inline:
                return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{content}", **kw}
            return {"role": "assistant", "content": content, "reasoning_content": reasoning, **kw}
        call = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
        return Conversation("r", (
            {"role": "user", "content": "Hi"},
            reply("greet back", "Hello!"),
            {"role": "user", "content": "Weather in Oslo?"},
            reply("need the tool", "", tool_calls=call),
            {"role": "tool", "content": "-3 C"},
            reply("it is cold", "It is -3 C."),
        ), tools=(WEATHER_TOOL,))
    a, b = chat.encode(conv(inline=True)), chat.encode(conv(inline=False))
    assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)
    assert _span_texts(qwen3_tokenizer, a) == [
        "Hello!<|im_end|>",  # before the last user turn: the template drops the reasoning
        '<think>\nneed the tool\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "<think>\nit is cold\n</think>\n\nIt is -3 C.<|im_end|>",
    ]
    assert "greet back" not in qwen3_tokenizer.decode(a.input_ids.tolist())


@pytest.mark.parametrize("enable_thinking, reasoning, supervised", [
    (None, None, EMPTY_THINK + "Four.<|im_end|>"),
    (True, None, EMPTY_THINK + "Four.<|im_end|>"),
    (False, None, "Four.<|im_end|>"),
    (None, "2+2=4", "<think>\n2+2=4\n</think>\n\nFour.<|im_end|>"),
    (True, "2+2=4", "<think>\n2+2=4\n</think>\n\nFour.<|im_end|>"),
    # The no-think generation prompt ends with "<think>": the model is given it, and what follows is supervised.
    (False, "2+2=4", "\n2+2=4\n</think>\n\nFour.<|im_end|>"),
])
def test_enable_thinking_decides_whether_the_think_block_is_prompt_or_reply(qwen3_tokenizer, enable_thinking, reasoning, supervised):
    """Qwen3: with thinking on (or the template default) the final reply's think block is supervised; with it
    off the empty think block belongs to the generation prompt and only the answer is supervised."""
    chat = ChatTokeniser(qwen3_tokenizer, max_length=1 << 20, enable_thinking=enable_thinking)
    reply = {"role": "assistant", "content": "Four."}
    if reasoning:
        reply["reasoning_content"] = reasoning
    sample = chat.encode(Conversation("t", ({"role": "user", "content": "2+2?"}, reply)))
    assert _span_texts(qwen3_tokenizer, sample) == [supervised]
    assert chat.enable_thinking is enable_thinking


# Other record forms -------------------------------------------------------------------------


def test_a_pretokenised_record_is_used_as_is_under_the_same_length_and_supervision_rules(qwen3_tokenizer):
    """Ids and mask are kept as given; truncation cuts both, drop-long skips, out-of-vocabulary ids and fewer
    than two consecutive supervised tokens are skipped with their reason."""
    ids = np.arange(100, 120, dtype=np.int64)
    mask = np.array([0] * 5 + [1] * 10 + [0] * 5, dtype=np.uint8)
    rec = PretokenisedRecord("p", ids, mask)
    whole = ChatTokeniser(qwen3_tokenizer, max_length=64).encode(rec)
    assert whole.input_ids.dtype == np.int32 and whole.input_ids.tolist() == ids.tolist()
    assert whole.loss_mask.tolist() == mask.tolist() and not whole.truncated
    cut = ChatTokeniser(qwen3_tokenizer, max_length=8).encode(rec)
    assert cut.truncated and cut.input_ids.tolist() == ids[:8].tolist() and cut.loss_mask.tolist() == mask[:8].tolist()
    with pytest.raises(BadRecord) as info:
        ChatTokeniser(qwen3_tokenizer, max_length=8, over_length="drop").encode(rec)
    assert info.value.reason == "too_long" and "20 tokens > --max-length 8" in info.value.detail
    with pytest.raises(BadRecord) as info:
        ChatTokeniser(qwen3_tokenizer, max_length=6).encode(rec)  # one supervised token left
    assert info.value.reason == "no_supervised_tokens"

    vocab = len(qwen3_tokenizer)
    assert vocab == 151_669
    oov = PretokenisedRecord("oov", np.array([1, 2, vocab, 3], dtype=np.int64), np.array([0, 1, 1, 1], dtype=np.uint8))
    with pytest.raises(BadRecord) as info:
        ChatTokeniser(qwen3_tokenizer, max_length=64).encode(oov)
    assert info.value.reason == "bad_pretokenised"
    assert f"input_ids[2] = {vocab} is outside the tokenizer's vocabulary [0, {vocab})" in info.value.detail
    last = PretokenisedRecord("last", np.array([1, 2, vocab - 1], dtype=np.int64), np.array([0, 1, 1], dtype=np.uint8))
    assert ChatTokeniser(qwen3_tokenizer, max_length=64).encode(last).input_ids[-1] == vocab - 1


def test_a_text_record_supervises_every_token_of_the_text_but_not_an_added_bos(qwen3_tokenizer):
    """Qwen adds no special tokens: ids = tokenizer(text), all supervised. A tokenizer that adds a BOS: the
    BOS is kept in the row (as the model is fed) but not supervised."""
    from tokenizers.processors import TemplateProcessing

    text = "Plain text, <|im_end|> included, is supervised everywhere."
    rec = TextRecord("txt", text)
    sample = ChatTokeniser(qwen3_tokenizer, max_length=256).encode(rec)
    assert sample.input_ids.tolist() == qwen3_tokenizer(text)["input_ids"]
    assert sample.loss_mask.tolist() == [1] * sample.num_tokens

    with_bos = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|object_ref_start|> $A", special_tokens=[("<|object_ref_start|>", 151646)])
    bos_sample = ChatTokeniser(with_bos, max_length=256).encode(rec)
    assert bos_sample.input_ids.tolist() == [151646] + sample.input_ids.tolist()
    assert bos_sample.loss_mask.tolist() == [0] + [1] * sample.num_tokens
    slow_path = ChatTokeniser(with_bos, max_length=256)
    slow_path._backend = None  # the slow-tokenizer path finds the text's ids inside the ids with specials
    assert slow_path.encode(rec).loss_mask.tolist() == bos_sample.loss_mask.tolist()


def test_encode_many_gives_what_encode_gives_on_mixed_record_forms(chat):
    """Conversations, pre-tokenised and text records interleaved: same samples and errors, in input order."""
    records = [
        _conv("c1", ("user", "Q"), ("assistant", "An answer.")),
        TextRecord("t1", "Some text to learn."),
        PretokenisedRecord("p1", np.array([5, 6, 7, 8], dtype=np.int64), np.array([0, 1, 1, 1], dtype=np.uint8)),
        PretokenisedRecord("p2", np.array([5, 10**7], dtype=np.int64), np.array([1, 1], dtype=np.uint8)),
        _conv("c2", ("user", None), ("assistant", "A")),  # type: ignore[arg-type]
        TextRecord("t2", "More text here, also supervised."),
        _conv("c3", ("user", "Q2"), ("assistant", "Another answer.")),
    ]
    batched = list(chat.encode_many(records, chunk_records=3))
    assert len(batched) == len(records)
    for rec, got in zip(records, batched):
        try:
            want = chat.encode(rec)
        except BadRecord as err:
            assert isinstance(got, BadRecord) and (got.record_id, got.reason) == (err.record_id, err.reason)
            continue
        assert got.record_id == rec.record_id
        assert np.array_equal(got.input_ids, want.input_ids) and np.array_equal(got.loss_mask, want.loss_mask)
    assert [getattr(x, "reason", None) for x in batched] == [None, None, None, "bad_pretokenised", "template_error", None, None]


# Length policy ------------------------------------------------------------------------------


def _long_conversation(n_turns: int = 24) -> list[tuple[str, str]]:
    turns = [("system", "You answer at length.")]
    for i in range(n_turns):
        turns.append(("user", f"Question {i}: " + " ".join(f"topic{i}-{j}" for j in range(60))))
        turns.append(("assistant", f"Answer {i}: " + " ".join(f"point{i}-{j} is noted" for j in range(70))))
    return turns


def test_a_20000_token_conversation_is_truncated_to_4096_or_dropped_and_counted_either_way(tmp_path, qwen3_tokenizer, chat):
    """--max-length 4096: truncated, the row is ids[:4096] and mask[:4096] of the whole render and counted as
    truncated; with --drop-long it is skipped as too_long. A short record next to it is unaffected."""
    turns = _long_conversation()
    full = chat.encode(_conv("long", *turns))
    assert 20_000 <= full.num_tokens <= 22_000, full.num_tokens
    path = tmp_path / "long.jsonl"
    short = {"id": "short", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    path.write_text(json.dumps({"id": "long", "messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"
                    + json.dumps(short) + "\n")

    skips = SkipCounter()
    opts = PlanOptions(dataset=str(path), model="unused")
    rids, ids, masks, truncated = tokenise_dataset(opts, ChatTokeniser(qwen3_tokenizer, max_length=4096), skips)
    assert rids == ["long", "short"] and truncated == [True, False] and skips.total == 0
    assert ids[0].shape == (4096,) and masks[0].shape == (4096,)
    assert np.array_equal(ids[0], full.input_ids[:4096]) and np.array_equal(masks[0], full.loss_mask[:4096])

    skips = SkipCounter()
    opts = PlanOptions(dataset=str(path), model="unused", over_length="drop")
    chat_drop = ChatTokeniser(qwen3_tokenizer, max_length=4096, over_length="drop")
    rids, ids, masks, truncated = tokenise_dataset(opts, chat_drop, skips)
    assert rids == ["short"] and truncated == [False]
    assert skips.counts == {"too_long": 1}
    assert skips.examples["too_long"] == [f"long: {full.num_tokens} tokens > --max-length 4096 (dropped: "
                                          "--drop-long; without it the sample is truncated)"]


def test_drop_long_skips_a_huge_record_without_tokenising_it_and_a_long_one_after(qwen3_tokenizer):
    """With --drop-long, a render longer than max_length x the most characters one token can cover
    (4 x the longest vocabulary string's bytes: 1,024 for Qwen3) is too long whatever its tokens: it
    is skipped before it is tokenised (a 30 MB record took 80 s and 5 GB of memory to tokenise, then
    to be dropped). One under that bound is tokenised and dropped by its count, as before."""
    chat = ChatTokeniser(qwen3_tokenizer, max_length=16, over_length="drop")
    huge = _conv("huge", ("user", "Summarise this."), ("assistant", "x" * (16 * 1024)))
    with pytest.raises(BadRecord) as info:
        chat.encode(huge)
    assert info.value.reason == "too_long" and info.value.record_id == "huge"
    assert "characters, so more than 16 tokens (no token covers more than 1024 characters" in info.value.detail
    assert "dropped before tokenising" in info.value.detail
    long = _conv("long", ("user", "Summarise this."), ("assistant", "one two three " * 20))
    with pytest.raises(BadRecord) as info:
        chat.encode(long)
    assert info.value.reason == "too_long" and "tokens > --max-length 16 (dropped: " in info.value.detail
    kept = ChatTokeniser(qwen3_tokenizer, max_length=16).encode(huge)  # the default truncates it
    assert kept.truncated and kept.num_tokens == 16


def test_a_record_naming_its_supervised_turns_has_only_those_masked_and_the_same_ids(tmp_path, chat, qwen3_tokenizer):
    """``hsx_supervised_turns`` (what a regenerate run's extraction gives: the target's answers) keeps
    the other assistant turns as context: the same ids, the mask over the named turns only. A list
    naming a turn that is not the assistant's is a skipped record with its reason."""
    turns = [{"role": r, "content": c} for r, c in SYSTEM_3_TURNS]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "all", "messages": turns},
        {"id": "last", "messages": turns, "hsx_supervised_turns": [6]},
        {"id": "two", "messages": turns, "hsx_supervised_turns": [2, 6]},
        {"id": "bad", "messages": turns, "hsx_supervised_turns": [1]},
    ]) + "\n")
    skips = SkipCounter()
    convs = {c.record_id: c for c in iter_conversations(path, skips)}
    assert set(convs) == {"all", "last", "two"} and skips.counts == {"bad_turn": 1}
    every, last, two = (chat.encode(convs[k]) for k in ("all", "last", "two"))
    assert np.array_equal(every.input_ids, last.input_ids) and np.array_equal(every.input_ids, two.input_ids)
    texts = _span_texts(qwen3_tokenizer, every)
    assert len(texts) == 3
    assert _span_texts(qwen3_tokenizer, last) == texts[2:]
    assert _span_texts(qwen3_tokenizer, two) == [texts[0], texts[2]]


def test_an_unfinished_reply_is_supervised_through_its_last_token_not_the_end_of_turn_the_template_adds(
        tmp_path, chat, qwen3_tokenizer):
    """``hsx_unfinished_turns`` (a regenerate run's answers cut at --max-new-tokens): the target never
    generated the <|im_end|> after such a reply, so it is mask 0 while the reply's tokens stay 1; the
    same conversation without the key supervises it. Same ids either way; the other turns keep
    theirs. A reply ending in the text ``<|im_end|>`` (content is text) keeps those text tokens."""
    cut = [*SYSTEM_3_TURNS[:-1], ("assistant", "You're welcome — anything")]
    turns = [{"role": r, "content": c} for r, c in cut]
    literal = [*turns[:-1], {"role": "assistant", "content": "It ends with <|im_end|>"}]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "finished", "messages": turns, "hsx_supervised_turns": [6]},
        {"id": "cut", "messages": turns, "hsx_supervised_turns": [6], "hsx_unfinished_turns": [6]},
        {"id": "cut-middle", "messages": turns, "hsx_unfinished_turns": [4]},
        {"id": "literal", "messages": literal, "hsx_unfinished_turns": [6]},
    ]) + "\n")
    skips = SkipCounter()
    convs = {c.record_id: c for c in iter_conversations(path, skips)}
    assert skips.total == 0
    finished, unfinished, middle, every = (chat.encode(convs[k]) for k in ("finished", "cut", "cut-middle", "literal"))
    reply = EMPTY_THINK + cut[-1][1]
    assert np.array_equal(finished.input_ids, unfinished.input_ids) and finished.input_ids[-2] == IM_END
    assert _span_texts(qwen3_tokenizer, finished) == [reply + "<|im_end|>"]
    assert _span_texts(qwen3_tokenizer, unfinished) == [reply]
    eot = finished.num_tokens - 2  # <|im_end|>\n closes the render
    assert finished.loss_mask[eot] == 1 and unfinished.loss_mask[eot] == 0
    assert np.array_equal(np.flatnonzero(finished.loss_mask != unfinished.loss_mask), [eot])
    # an unfinished turn in the middle: only its own <|im_end|> is left out
    assert _span_texts(qwen3_tokenizer, middle) == ["4.<|im_end|>", cut[4][1], reply + "<|im_end|>"]
    # the reply's own text "<|im_end|>" is content (supervised); the template's <|im_end|> after it is not
    assert every.input_ids[-2] == IM_END and every.loss_mask[-2] == 0
    assert _span_texts(qwen3_tokenizer, every)[-1] == EMPTY_THINK + "It ends with <|im_end|>"
    assert every.loss_mask[-3] == 1 and every.input_ids[-3] != IM_END


def test_an_unfinished_reply_leaves_out_what_the_template_adds_after_its_content():
    """A template that trims a reply and signs it before the end-of-turn token: an unfinished reply
    is supervised through its own last token, neither the signature nor the end-of-turn token."""
    tok = AutoTokenizer.from_pretrained(QWEN3_TOKENIZER_DIR)
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                         "{{ m.content | trim }} (signed){% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    chat = ChatTokeniser(tok, max_length=1 << 20)
    turns = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there \n"})
    assert _span_texts(tok, chat.encode(Conversation("c", turns))) == ["Hello there (signed)<|im_end|>"]
    assert _span_texts(tok, chat.encode(Conversation("c", turns, unfinished_turns=frozenset({1})))) == ["Hello there"]


def test_a_bad_unfinished_turns_list_is_a_skipped_record_naming_it(tmp_path):
    """``hsx_unfinished_turns`` is checked as ``hsx_supervised_turns`` is: a list of indices of
    assistant turns (supervised ones, when the record names them), else the record is ``bad_turn``."""
    turns = [{"role": r, "content": c} for r, c in SYSTEM_3_TURNS]
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"id": "good", "messages": turns, "hsx_unfinished_turns": []},
        {"id": "not-a-list", "messages": turns, "hsx_unfinished_turns": 6},
        {"id": "a-user-turn", "messages": turns, "hsx_unfinished_turns": [5]},
        {"id": "past-the-end", "messages": turns, "hsx_unfinished_turns": [7]},
        {"id": "not-supervised", "messages": turns, "hsx_supervised_turns": [6], "hsx_unfinished_turns": [4]},
    ]) + "\n")
    skips = SkipCounter()
    assert [c.record_id for c in iter_conversations(path, skips)] == ["good"]
    assert skips.counts == {"bad_turn": 4}
    assert skips.examples["bad_turn"] == [
        "not-a-list (line 2): hsx_unfinished_turns is not a list of turn indices",
        "a-user-turn (line 3): hsx_unfinished_turns: turn 5 is not an assistant turn (of 7 turns, numbered from 0)",
        "past-the-end (line 4): hsx_unfinished_turns: turn 7 is not an assistant turn (of 7 turns, numbered from 0)",
        "not-supervised (line 5): hsx_unfinished_turns: turn 4 is not one of the hsx_supervised_turns [6]",
    ]
