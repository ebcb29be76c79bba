"""Chat template, tokenisation and the assistant-only loss mask.

One conversation becomes one row of token ids and a mask that is 1 on the tokens the draft model is
trained to predict: every assistant reply, from its first token to its end-of-turn token
(inclusive); nothing of system, user or tool turns, nor of the role headers.

Why not ``return_assistant_tokens_mask``: the Qwen3 template has no ``{% generation %}`` markers,
and then transformers silently returns an all-zero mask (FIELD-NOTES 3). The method here works
with any template ("render boundary", as in speculators and NeMo Automodel):

1. render the whole conversation once and tokenise it once (``add_special_tokens=False``);
2. for assistant turn i, render ``messages[:i]`` with the generation prompt: P_i. The reply starts
   at the first token of the full row that is not entirely inside P_i. Positions are taken on the
   tokens of the full row, never by cutting text: BPE merges across the header/content boundary
   (``"assistant\\n" + "\\nHi"`` gives one token ``"\\n\\n"``). When P_i is a text prefix of the
   full render (the usual case) the start is read from the full row's offset mapping: the first
   token whose end offset is past ``len(P_i)``; P_i is not tokenised. Otherwise (templates that
   move or add ``<think>`` blocks: Qwen3 with ``enable_thinking=False``, or two assistant turns in
   a row, where Qwen3 renders the first one as "last") P_i is tokenised and compared on token ids:
   longest common prefix, or, when P_i already differs before its last end-of-turn token, aligned
   on the full row by its count of end-of-turn tokens;
3. supervision runs from that token through the first end-of-turn token at or after it.

Conventions: ``loss_mask[t] = 1`` means token t is a target (not shifted; a trainer that predicts
t+1 from t shifts it). A token that straddles the boundary (the ``"\\n\\n"`` above: header newline
+ the reply's own leading newline) is supervised: it is the first token the reply changes. The
empty ``<think>\\n\\n</think>\\n\\n`` that the Qwen3 template puts before the final assistant reply
(after the last user turn) is rendered after the generation prompt, so it is supervised as part of
the reply; with ``enable_thinking=False`` the generation prompt holds it, and it is not.
Content is tokenised with special tokens recognised (as serving stacks do): a literal
``<|im_end|>`` inside a reply would end its supervision early (ShareGPT V3 has none; two replies
contain ``<|endoftext|>``, which is not an end-of-turn token for Qwen3).

Tools and reasoning are the template's business: a record's ``tools`` go to it as ``tools=``,
``tool_calls`` and ``reasoning_content`` stay on their messages, and what the template renders of
an assistant turn (Qwen3: ``<think>`` block, text, ``<tool_call>`` blocks) is supervised like any
reply; tool results are input turns and never supervised. Qwen3 renders the reasoning of a reply
only after the last user turn (earlier replies lose theirs, in the row and in the mask), as it does
when serving. With ``enable_thinking=False`` its generation prompt ends with an empty
``<think>\n\n</think>\n\n``; a final reply that carries reasoning anyway is rendered with it, and
supervision starts after the ``<think>`` token the prompt already holds.

Other record forms (:mod:`producer.datasets`): a :class:`~producer.datasets.PretokenisedRecord`
is used as is (ids must be in ``[0, len(tokenizer))``); a :class:`~producer.datasets.TextRecord`
is tokenised with ``add_special_tokens=True`` (what ``tokenizer(text)`` does: a BOS for Llama-style
tokenizers, nothing for Qwen) and every token of the text is supervised, the tokens the tokenizer
adds (BOS) are not; no end-of-sequence token is appended.

All forms then follow the same rules: a row longer than ``max_length`` is cut to ``max_length``
(``over_length="truncate"``, the mask cut the same way) or skipped as ``too_long``
(``over_length="drop"``), and a row without two consecutive supervised tokens is skipped as
``no_supervised_tokens``.
"""

from __future__ import annotations

import hashlib
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from core.errors import BadConfig, BadRecord
from producer.datasets import Conversation, PretokenisedRecord, Record, TextRecord

#: A sample needs at least this many supervised tokens, consecutive: DFlash trains on blocks of
#: consecutive targets and skips samples without two (FIELD-NOTES 8).
MIN_CONSECUTIVE_SUPERVISED = 2

#: What to do with a row longer than ``max_length`` tokens: cut it, or skip it (``too_long``).
OVER_LENGTH_POLICIES = ("truncate", "drop")

#: Reasons :class:`ChatTokeniser` skips a record for (keys of the same SkipCounter as
#: :data:`producer.datasets.SKIP_REASONS`).
ENCODE_SKIP_REASONS = ("template_error", "bad_pretokenised", "too_long", "no_supervised_tokens")

_PROBE = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]


@dataclass(frozen=True)
class TokenisedSample:
    """One conversation as the model sees it.

    ``input_ids``: int32 [S]; ``loss_mask``: uint8 [S], 1 on supervised tokens (assistant replies
    and their end-of-turn token), with at least two consecutive ones; ``truncated``: the render was
    longer than ``max_length`` tokens and was cut to S = max_length (the mask is cut the same way).
    """

    record_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_supervised(self) -> int:
        return int(self.loss_mask.sum())


class ChatTokeniser:
    """Renders conversations with a tokenizer's chat template and builds the assistant loss mask.

    ``tokenizer``: a transformers tokenizer with a chat template (a fast one gives the offset
    mapping that avoids re-tokenising prefixes; a slow one works, slower). ``max_length``: tokens
    per sample. ``over_length``: one of :data:`OVER_LENGTH_POLICIES`: longer rows are truncated
    (default) or skipped as ``too_long``. ``enable_thinking`` is passed to the template when not
    None (Qwen3 templates read it; None keeps the template's default); ``chat_template_kwargs`` are
    passed to every render. ``vocab_size`` (= ``len(tokenizer)``) bounds pre-tokenised ids.

    Attributes: ``template_sha256`` (hex sha256 of the template text, for the run config);
    ``end_of_turn_ids`` (token ids that close an assistant reply: the special token the template
    writes after a reply, found by rendering a probe conversation, plus ``eos_token_id``).
    Raises BadConfig when the tokenizer has no chat template or no end-of-turn token is found.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_length: int,
        enable_thinking: bool | None = None,
        chat_template_kwargs: dict | None = None,
        over_length: str = "truncate",
    ):
        if max_length < MIN_CONSECUTIVE_SUPERVISED:
            raise BadConfig(f"max_length={max_length} tokens: must be at least {MIN_CONSECUTIVE_SUPERVISED}")
        if over_length not in OVER_LENGTH_POLICIES:
            raise BadConfig(f"over_length={over_length!r}: choose one of {', '.join(OVER_LENGTH_POLICIES)}")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
        self.over_length = over_length
        self.enable_thinking = enable_thinking
        self.vocab_size = len(tokenizer)
        try:
            template = tokenizer.get_chat_template()
        except ValueError as err:
            raise BadConfig(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template ({err}): "
                "use the chat/instruct model's tokenizer or set one with tokenizer.chat_template"
            ) from None
        self.template_sha256 = hashlib.sha256(template.encode("utf-8")).hexdigest()
        self._kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            self._kwargs["enable_thinking"] = enable_thinking
        # The Rust tokenizer directly: one call gives ids and offsets without the Python wrapper.
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        self.end_of_turn_ids = self._probe_end_of_turn_ids()
        self._eot_array = np.array(sorted(self.end_of_turn_ids), dtype=np.int32)

    # ----------------------------------------------------------------------------------------

    def encode(self, record: Record) -> TokenisedSample:
        """Token ids and loss mask of one record (see the module docstring for the method).

        Raises BadRecord with reason ``template_error`` (the template raised, or its renders of the
        prefixes do not line up with the full render), ``bad_pretokenised`` (an id outside the
        vocabulary), ``too_long`` (longer than ``max_length`` with ``over_length="drop"``) or
        ``no_supervised_tokens`` (fewer than two consecutive supervised tokens remain after
        truncation at ``max_length``).
        """
        if isinstance(record, PretokenisedRecord):
            return self._encode_pretokenised(record)
        if isinstance(record, TextRecord):
            return self._encode_text(record, *self._tokenise_texts([record.text])[0])
        messages = list(record.messages)
        full = self._render(record, messages, add_generation_prompt=False)
        ids, ends = self._tokenise(full, with_offsets=True)
        return self._encode_rendered(record, messages, full, ids, ends)

    def encode_many(self, records: Iterable[Record], *, chunk_records: int = 256
                    ) -> Iterator[TokenisedSample | BadRecord]:
        """:meth:`encode` over a stream of records, tokenising on all cores; yields in order.

        Yields, for each record, its sample or the BadRecord that :meth:`encode` would have
        raised. Tokenisation is most of the cost: each chunk of ``chunk_records`` full renders (and
        plain texts) is tokenised in one batch call (parallel in Rust, GIL released) on a helper
        thread while this thread renders the next chunk and builds the masks of the previous one.
        Pre-tokenised records only pass through. Memory: two chunks of token offsets at a time.
        """
        pending: tuple[list, Future | None] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenise") as pool:
            for chunk in _chunks(records, chunk_records):
                # Per item: (conv, messages, full render) | BadRecord | TextRecord | PretokenisedRecord
                rendered: list = []
                for rec in chunk:
                    if not isinstance(rec, Conversation):
                        rendered.append(rec)
                        continue
                    messages = list(rec.messages)
                    try:
                        rendered.append((rec, messages, self._render(rec, messages, add_generation_prompt=False)))
                    except BadRecord as err:
                        rendered.append(err)
                chat_texts = [r[2] for r in rendered if isinstance(r, tuple)]
                plain_texts = [r.text for r in rendered if isinstance(r, TextRecord)]
                future = pool.submit(self._tokenise_batch, chat_texts, plain_texts)
                if pending is not None:
                    yield from self._finish_chunk(*pending)
                pending = (rendered, future)
            if pending is not None:
                yield from self._finish_chunk(*pending)

    def _tokenise_batch(self, chat_texts: list[str], plain_texts: list[str]) -> tuple[list, list]:
        """(ids, end offsets) of each chat render, (ids, added-token flags) of each plain text."""
        if self._backend is not None:
            chat = [(e.ids, _end_offsets(e)) for e in self._backend.encode_batch(chat_texts, add_special_tokens=False)]
        else:
            chat = [self._tokenise(t, with_offsets=True) for t in chat_texts]
        return chat, (self._tokenise_texts(plain_texts) if plain_texts else [])

    def _finish_chunk(self, rendered: list, future: Future) -> Iterator[TokenisedSample | BadRecord]:
        chat, plain = future.result()
        chat_it, plain_it = iter(chat), iter(plain)
        for item in rendered:
            if isinstance(item, BadRecord):
                yield item
                continue
            try:
                if isinstance(item, PretokenisedRecord):
                    yield self._encode_pretokenised(item)
                elif isinstance(item, TextRecord):
                    yield self._encode_text(item, *next(plain_it))
                else:
                    conv, messages, full = item
                    yield self._encode_rendered(conv, messages, full, *next(chat_it))
            except BadRecord as err:
                yield err

    def _encode_rendered(
        self, conv: Conversation, messages: list[dict], full: str, ids: list[int], ends: np.ndarray | None
    ) -> TokenisedSample:
        """The mask of a conversation whose full render ``full`` tokenised to ``ids`` (end offsets ``ends``)."""
        rid = conv.record_id
        ids_S = np.asarray(ids, dtype=np.int32)
        self._check_length(rid, ids_S.shape[0])  # before the prefix renders: a dropped row costs none
        eot_pos = np.flatnonzero(np.isin(ids_S, self._eot_array))
        loss_mask_S = np.zeros(ids_S.shape[0], dtype=np.uint8)

        prev_end = -1
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = self._render(conv, messages[:i], add_generation_prompt=True)
            if ends is not None and full.startswith(prompt):
                # First token that is not entirely inside the prompt text (ends are non-decreasing).
                start = int(np.searchsorted(ends, len(prompt), side="right"))
            else:
                start = self._start_by_token_ids(rid, i, prompt, ids_S, eot_pos)
            if start <= prev_end:
                raise BadRecord(rid, "template_error",
                                f"assistant turn {i} would start at token {start}, inside the previous "
                                f"reply (ends at {prev_end}): the template's prefix renders do not line up")
            k = int(np.searchsorted(eot_pos, start, side="left"))
            if k >= eot_pos.shape[0]:
                raise BadRecord(rid, "template_error",
                                f"assistant turn {i}: no end-of-turn token {sorted(self.end_of_turn_ids)} "
                                f"after token {start} of {ids_S.shape[0]}")
            end = int(eot_pos[k])
            loss_mask_S[start:end + 1] = 1
            prev_end = end
            if end >= self.max_length:
                break  # later replies are cut off by truncation: spare their prompt renders
        return self._sample(rid, ids_S, loss_mask_S)

    def _encode_pretokenised(self, rec: PretokenisedRecord) -> TokenisedSample:
        """A pre-tokenised record as given, after the vocabulary check; same length rules."""
        out = np.flatnonzero(rec.input_ids >= self.vocab_size)
        if out.shape[0]:
            raise BadRecord(rec.record_id, "bad_pretokenised",
                            f"input_ids[{int(out[0])}] = {int(rec.input_ids[out[0]])} is outside the tokenizer's "
                            f"vocabulary [0, {self.vocab_size}) ({out.shape[0]} such ids): was it tokenised for another model?")
        return self._sample(rec.record_id, rec.input_ids.astype(np.int32), rec.loss_mask.astype(np.uint8, copy=True))

    def _encode_text(self, rec: TextRecord, ids: list[int], added_S: np.ndarray) -> TokenisedSample:
        """A plain text: every token supervised except those the tokenizer added (BOS)."""
        return self._sample(rec.record_id, np.asarray(ids, dtype=np.int32), (~added_S).astype(np.uint8))

    def _tokenise_texts(self, texts: list[str]) -> list[tuple[list[int], np.ndarray]]:
        """Ids of plain texts with the tokenizer's own special tokens (``add_special_tokens=True``),
        and bool [S] flags of the tokens it added (not from the text)."""
        if self._backend is not None:
            return [(e.ids, np.fromiter((s is None for s in e.sequence_ids), dtype=bool, count=len(e.ids)))
                    for e in self._backend.encode_batch(texts, add_special_tokens=True)]
        out = []
        for text in texts:  # slow tokenizer: find the text's own ids inside the ids with specials
            ids = self.tokenizer.encode(text, add_special_tokens=True)
            own = self.tokenizer.encode(text, add_special_tokens=False)
            added = np.zeros(len(ids), dtype=bool)
            at = next((k for k in range(len(ids) - len(own) + 1) if ids[k:k + len(own)] == own), None)
            if at is not None:
                added[:at] = True
                added[at + len(own):] = True
            out.append((ids, added))
        return out

    def _check_length(self, rid: str, num_tokens: int) -> None:
        if self.over_length == "drop" and num_tokens > self.max_length:
            raise BadRecord(rid, "too_long", f"{num_tokens} tokens > max_length={self.max_length} "
                            "(dropped: over_length='drop'; the default truncates)")

    def _sample(self, rid: str, ids_S: np.ndarray, loss_mask_S: np.ndarray) -> TokenisedSample:
        """Truncate at ``max_length`` and check the supervised tokens: the rules shared by all forms."""
        self._check_length(rid, ids_S.shape[0])
        truncated = ids_S.shape[0] > self.max_length
        if truncated:
            ids_S = ids_S[: self.max_length].copy()
            loss_mask_S = loss_mask_S[: self.max_length].copy()
        if not np.any(loss_mask_S[1:] & loss_mask_S[:-1]):
            raise BadRecord(rid, "no_supervised_tokens",
                            f"{int(loss_mask_S.sum())} supervised tokens in {ids_S.shape[0]}"
                            + (f" after truncation at max_length={self.max_length}" if truncated else "")
                            + f"; need {MIN_CONSECUTIVE_SUPERVISED} consecutive")
        return TokenisedSample(record_id=rid, input_ids=ids_S, loss_mask=loss_mask_S, truncated=truncated)

    # ----------------------------------------------------------------------------------------

    def _render(self, conv: Conversation | None, messages: list[dict], *, add_generation_prompt: bool) -> str:
        tools = list(conv.tools) if conv is not None and conv.tools else None
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
            )
        except Exception as err:  # jinja raises anything (TemplateError, TypeError on None content...)
            rid = conv.record_id if conv is not None else "<probe>"
            raise BadRecord(rid, "template_error", f"{type(err).__name__}: {err}") from None

    def _tokenise(self, text: str, *, with_offsets: bool) -> tuple[list[int], np.ndarray | None]:
        """Token ids of ``text`` (no special tokens added) and, from a fast tokenizer, end offsets."""
        if self._backend is not None:
            enc = self._backend.encode(text, add_special_tokens=False)
            return enc.ids, (_end_offsets(enc) if with_offsets else None)
        return self.tokenizer.encode(text, add_special_tokens=False), None

    def _start_by_token_ids(self, rid: str, i: int, prompt: str, ids_S: np.ndarray, eot_pos: np.ndarray) -> int:
        """First reply token of assistant turn i when the prompt render is not a text prefix.

        The longest common prefix of token ids is right when only the tail of the prompt differs
        (a generation prompt with an empty think block). When the prompt differs earlier (the
        template rendered an earlier turn differently because it was last), the prompt is aligned
        on the full row by its end-of-turn count: its n-th end-of-turn token is the full row's
        n-th, and what follows (the generation prompt) is matched from there.
        """
        p_ids, _ = self._tokenise(prompt, with_offsets=False)
        p_ids_P = np.asarray(p_ids, dtype=np.int32)
        lcp = _common_prefix_len(p_ids_P, ids_S)
        p_eot = np.flatnonzero(np.isin(p_ids_P[lcp:], self._eot_array))
        if p_eot.shape[0] == 0:
            return lcp
        n_eot = int(np.isin(p_ids_P, self._eot_array).sum())
        if n_eot > eot_pos.shape[0]:
            raise BadRecord(rid, "template_error",
                            f"assistant turn {i}: the prompt render has {n_eot} end-of-turn tokens, "
                            f"the full render only {eot_pos.shape[0]}")
        last_p_eot = lcp + int(p_eot[-1])
        anchor = int(eot_pos[n_eot - 1]) + 1
        return anchor + _common_prefix_len(p_ids_P[last_p_eot + 1:], ids_S[anchor:])

    def _probe_end_of_turn_ids(self) -> frozenset[int]:
        """The special token the template writes right after an assistant reply, plus eos."""
        found: set[int] = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            found.add(eos)
        special = set(getattr(self.tokenizer, "all_special_ids", []))
        special.update(i for i, t in getattr(self.tokenizer, "added_tokens_decoder", {}).items() if t.special)
        text = self._render(None, _PROBE, add_generation_prompt=False)
        after = text.rfind("PONG") + len("PONG")
        if after >= len("PONG"):
            # Tokenise what follows the reply on its own: the first special token there closes it.
            ids, _ = self._tokenise(text[after:], with_offsets=False)
            for tok in ids:
                if tok in special:
                    found.add(int(tok))
                    break
        if not found:
            raise BadConfig(
                f"tokenizer {getattr(self.tokenizer, 'name_or_path', '?')!r}: no special token follows an "
                f"assistant reply in its chat template ({text!r}) and eos_token_id is unset: set "
                "tokenizer.eos_token to the end-of-turn token"
            )
        return frozenset(found)


def _chunks(items: Iterable, n: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _end_offsets(enc) -> np.ndarray:
    """int64 [S]: character offset (in the rendered text) where each token ends."""
    return np.fromiter((e for _, e in enc.offsets), dtype=np.int64, count=len(enc.ids))


def _common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two 1-D id arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.shape[0] else n
