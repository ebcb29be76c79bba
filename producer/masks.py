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
"""

from __future__ import annotations

import hashlib
import itertools
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from core.errors import BadConfig, BadRecord
from producer.datasets import Conversation

#: A sample needs at least this many supervised tokens, consecutive: DFlash trains on blocks of
#: consecutive targets and skips samples without two (FIELD-NOTES 8).
MIN_CONSECUTIVE_SUPERVISED = 2

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
    per sample; longer renders are truncated. ``enable_thinking`` is passed to the template when
    not None (Qwen3 templates read it); ``chat_template_kwargs`` are passed to every render.

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
    ):
        if max_length < MIN_CONSECUTIVE_SUPERVISED:
            raise BadConfig(f"max_length={max_length} tokens: must be at least {MIN_CONSECUTIVE_SUPERVISED}")
        self.tokenizer = tokenizer
        self.max_length = int(max_length)
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

    def encode(self, conv: Conversation) -> TokenisedSample:
        """Token ids and loss mask of one conversation (see the module docstring for the method).

        Raises BadRecord with reason ``template_error`` (the template raised, or its renders of the
        prefixes do not line up with the full render) or ``no_supervised_tokens`` (fewer than two
        consecutive supervised tokens remain after truncation at ``max_length``).
        """
        messages = list(conv.messages)
        full = self._render(conv.record_id, messages, add_generation_prompt=False)
        ids, ends = self._tokenise(full, with_offsets=True)
        return self._encode_rendered(conv.record_id, messages, full, ids, ends)

    def encode_many(self, convs: Iterable[Conversation], *, chunk_records: int = 256
                    ) -> Iterator[TokenisedSample | BadRecord]:
        """:meth:`encode` over a stream of conversations, tokenising on all cores; yields in order.

        Yields, for each conversation, its sample or the BadRecord that :meth:`encode` would have
        raised. Tokenisation is most of the cost: each chunk of ``chunk_records`` full renders is
        tokenised in one batch call (parallel in Rust, GIL released) on a helper thread while this
        thread renders the next chunk and builds the masks of the previous one. Memory: two chunks
        of token offsets at a time.
        """
        pending: tuple[list, Future | None] | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenise") as pool:
            for chunk in _chunks(convs, chunk_records):
                rendered: list[tuple[Conversation, list[dict], str] | BadRecord] = []
                for conv in chunk:
                    messages = list(conv.messages)
                    try:
                        rendered.append((conv, messages, self._render(conv.record_id, messages,
                                                                      add_generation_prompt=False)))
                    except BadRecord as err:
                        rendered.append(err)
                texts = [r[2] for r in rendered if not isinstance(r, BadRecord)]
                future = pool.submit(self._tokenise_batch, texts)
                if pending is not None:
                    yield from self._finish_chunk(*pending)
                pending = (rendered, future)
            if pending is not None:
                yield from self._finish_chunk(*pending)

    def _tokenise_batch(self, texts: list[str]) -> list[tuple[list[int], np.ndarray | None]]:
        if self._backend is not None:
            return [(e.ids, _end_offsets(e)) for e in self._backend.encode_batch(texts, add_special_tokens=False)]
        return [self._tokenise(t, with_offsets=True) for t in texts]

    def _finish_chunk(self, rendered: list, future: Future) -> Iterator[TokenisedSample | BadRecord]:
        tokenised = iter(future.result())
        for item in rendered:
            if isinstance(item, BadRecord):
                yield item
                continue
            conv, messages, full = item
            ids, ends = next(tokenised)
            try:
                yield self._encode_rendered(conv.record_id, messages, full, ids, ends)
            except BadRecord as err:
                yield err

    def _encode_rendered(
        self, rid: str, messages: list[dict], full: str, ids: list[int], ends: np.ndarray | None
    ) -> TokenisedSample:
        """The mask of a conversation whose full render ``full`` tokenised to ``ids`` (end offsets ``ends``)."""
        ids_S = np.asarray(ids, dtype=np.int32)
        eot_pos = np.flatnonzero(np.isin(ids_S, self._eot_array))
        loss_mask_S = np.zeros(ids_S.shape[0], dtype=np.uint8)

        prev_end = -1
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prompt = self._render(rid, messages[:i], add_generation_prompt=True)
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

    def _render(self, rid: str, messages: list[dict], *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
            )
        except Exception as err:  # jinja raises anything (TemplateError, TypeError on None content...)
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
        text = self._render("<probe>", _PROBE, add_generation_prompt=False)
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
