"""Chat template, tokenisation and the assistant-only loss mask.

One conversation becomes one row of token ids and a mask that is 1 on the tokens the draft model is
trained to predict: every assistant reply, from its first token to its end-of-turn token
(inclusive; an unfinished reply, cut at a length limit, to its last token); nothing of system, user or tool turns, nor of the role headers.

Why not ``return_assistant_tokens_mask``: the Qwen3 template has no ``{% generation %}`` markers,
and then transformers silently returns an all-zero mask (docs/FACTS.md §3). The method here works
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
3. supervision runs from that token through the first end-of-turn token at or after it. A turn the
   record names unfinished (``hsx_unfinished_turns``: a reply cut at a length limit, so the model
   never generated the end-of-turn token the template adds) is supervised through the token that
   holds the last character of its content only (found in the render between the reply's start and
   that end-of-turn token; a template that strips the content is allowed for): the end-of-turn
   token, and whatever the template renders between the content and it, are mask 0. When the
   content is not found there (a template that rewrote it), the turn carries ``tool_calls``
   (rendered after the content) or a slow tokenizer gives no offsets, everything but the
   end-of-turn token is supervised.

Conventions: ``loss_mask[t] = 1`` means token t is a target (not shifted; a trainer that predicts
t+1 from t shifts it). A token that straddles the boundary (the ``"\\n\\n"`` above: header newline
+ the reply's own leading newline) is supervised: it is the first token the reply changes. The
empty ``<think>\\n\\n</think>\\n\\n`` that the Qwen3 template puts before the final assistant reply
(after the last user turn) is rendered after the generation prompt, so it is supervised as part of
the reply; with ``enable_thinking=False`` the generation prompt holds it, and it is not.
**Content is text** (``special_tokens_in_content="text"``, the default). The render is one string,
so a special-token string written *inside* a message (``<|im_end|>`` in a reply, or
``<|im_end|>\n<|im_start|>assistant`` in a user turn) would otherwise become the special token
itself: it would end a reply's supervision early, or forge a turn boundary in the context. Only the
template's own special tokens are special; a special-token string in content (system, user,
assistant, tool and reasoning text, tool calls, tool definitions) is tokenised as plain text, as
``tokenizer(content, split_special_tokens=True)`` tokenises it. How: a conversation whose strings
hold no special-token string (nearly all: ShareGPT V3 has two replies with ``<|endoftext|>``) takes
the plain path, one tokenisation of the render, unchanged. Otherwise every special-token string in
its strings is replaced by a placeholder (``hsxesc<n>q<k>q``, ASCII letters and digits, so that no
template filter alters it; ``<n>`` is chosen so that ``hsxesc<n>`` occurs nowhere in the record)
before the template renders it. Every special-token string left in the render is then the
template's own; the render is cut at them (each one absorbs the whitespace its ``lstrip`` /
``rstrip`` flags say, as the tokenizer does), the pieces between them get their placeholders
replaced by the original strings and are tokenised with special tokens *not* recognised, and the
template's tokens go between them as their ids. This is what the tokenizer itself does to a render
(it cuts the text at special tokens and tokenises the pieces independently), except that the
content's strings no longer cut it; the render boundaries are found on the placeholder renders,
with lengths counted in the real text. A template that alters a placeholder (the record's text
then still holds ``hsxesc<n>``) makes the record a ``template_error``. Added tokens that are not
special (Qwen3's ``<think>`` 151667, ``<tool_call>``) keep their ids in content by default
(``added_tokens_in_content="token"``), as in ``split_special_tokens=True`` and as a serving engine
tokenises the rendered prompt (vLLM and SGLang render the template, then tokenise the text with
every added token matched), so the draft model is trained on the ids it will see; the Qwen3
template itself parses inline ``<think>`` blocks out of assistant content.
``added_tokens_in_content="text"`` escapes their strings too (same placeholders, same cut: the
render is cut at every special token and at the escaped strings, and the pieces are tokenised with
neither recognised), so content never holds one of these ids and the template never sees an inline
``<think>`` block (give reasoning as ``reasoning_content``). ``special_tokens_in_content="special"``
keeps the behaviour of runs made before (every special-token string in the render is special), for
datasets that embed special tokens on purpose; ``run.json`` records both modes.

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
adds (BOS) are not; no end-of-sequence token is appended. A plain text is not message content:
its special-token strings are special in either mode (documents joined by ``<|endoftext|>``).

All forms then follow the same rules: a row longer than ``max_length`` is cut to ``max_length``
(``over_length="truncate"``, the mask cut the same way) or skipped as ``too_long``
(``over_length="drop"``), and a row without two consecutive supervised tokens is skipped as
``no_supervised_tokens``.

**Truncation by prefix.** With ``over_length="truncate"``, a render longer than
``truncate_prefix_min_chars`` (:data:`TRUNCATE_PREFIX_CHARS_PER_TOKEN` = 64 characters per token of
``max_length``: no real record shorter than ``max_length`` tokens comes near it) is not tokenised
whole: a 30 MB conversation took 80 s and 5.4 GB per tokenising process, for 4,096 tokens kept. Only
a prefix of the render is tokenised, cut where its tokens are provably the whole render's first
tokens, and grown (doubling, from 6 characters per token wanted) until it gives more than
``max_length`` of them or is the whole render; the sample is then exactly the one whole
tokenisation and cutting give (ids, mask, ``truncated``, skips). Why the cut is exact: the tokenizer
splits the text at its added tokens, normalizes each piece (none or NFC), splits it with the
pre-tokenizer regex and runs BPE inside each pre-token; so the prefix tokenises like the whole text
wherever both split into the same pre-tokens. The cut is never inside an added-token string, and is
made only between two characters whose classes make every regex match before it end there and
read the same whether the regex then meets the next character or the end of the text
(:func:`_safe_pair`, for the Qwen2 / Qwen3 regex: after a digit; before a digit; after a letter and
before a non-letter; after punctuation and before a space or tab; after a newline and before a
non-space; never after a space, which ``\s+(?!\S)`` reads differently at the end), and only where
the character after the cut is one that NFC never composes with what precedes it (ASCII and a few
long-assigned scripts). A run with no such cut (a megabyte of spaces, letters or emoji) is tokenised
to its end, as it must be. Renders with placeholders (content is text) are cut at the template's
special tokens as always, and the piece holding the cut is cut the same way. The mask is built on
those tokens; where a reply's start or end lies beyond them, what the whole row would do is read
from the render's text (its end-of-turn tokens are counted as strings: no added-token string can
overlap another, and BPE never gives their ids), and where that cannot be told (an unfinished reply
cut by the prefix, a prompt that differs from the render before the cut, a template that leaves a
reply without end-of-turn token) the render is tokenised whole. So is every render of a tokenizer
whose parts are not these (``_prefix_tokenisable``: another regex or normalizer, no offsets), and
every render with ``over_length="drop"``, whose rule above skips huge renders untokenised.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import threading
import unicodedata
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from hsx.errors import BadConfig, BadRecord
from producer.datasets import Conversation, PretokenisedRecord, Record, TextRecord

#: A sample needs at least this many supervised tokens, consecutive: DFlash trains on blocks of
#: consecutive targets and skips samples without two (docs/FACTS.md §8).
MIN_CONSECUTIVE_SUPERVISED = 2

#: What to do with a row longer than ``max_length`` tokens: cut it, or skip it (``too_long``).
OVER_LENGTH_POLICIES = ("truncate", "drop")

#: Reasons :class:`ChatTokeniser` skips a record for (keys of the same SkipCounter as
#: :data:`producer.datasets.SKIP_REASONS`).
ENCODE_SKIP_REASONS = ("template_error", "bad_pretokenised", "too_long", "no_supervised_tokens")

#: How special-token strings inside message content are tokenised: ``text`` (plain text; only the
#: template's own special tokens are special) or ``special`` (as special tokens: runs made before
#: this choice existed; for datasets that embed special tokens on purpose). Recorded in run.json.
SPECIAL_TOKENS_IN_CONTENT = ("text", "special")

#: How the strings of added tokens that are *not* special (Qwen3's ``<think>``, ``<tool_call>``)
#: inside message content are tokenised: ``token`` (their token ids, the default: what a serving
#: engine does to the rendered prompt, and what every run before this choice did) or ``text``
#: (plain text, like special-token strings in ``text`` mode). Recorded in run.json.
ADDED_TOKENS_IN_CONTENT = ("token", "text")

#: The text-mode copies of Rust tokenizers (``ChatTokeniser._text_backend``), by the tokenizer's
#: ``id`` (the tokenizer is held beside its copy, so the id is not reused) and the content modes.
_TEXT_BACKENDS: dict[tuple, tuple] = {}
_TEXT_BACKENDS_LOCK = threading.Lock()

_PROBE = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]
#: First part of the placeholders that stand for special-token strings of content while the template
#: renders it (see the module docstring): ``hsxesc<n>q<k>q``.
_MARKER = "hsxesc"

#: With ``over_length="truncate"``, a render longer than this many characters per token of
#: ``max_length`` is tokenised by prefix (module docstring, "Truncation by prefix"): no real record
#: shorter than ``max_length`` tokens comes near it (English runs about 4 characters a token).
TRUNCATE_PREFIX_CHARS_PER_TOKEN = 64
#: The first prefix tried holds this many characters per token wanted; each retry doubles it.
_PREFIX_START_CHARS_PER_TOKEN = 6
#: The pre-tokenizer regex whose cut points :func:`_safe_cut` knows (Qwen2, Qwen2.5, Qwen3).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


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
    ``special_tokens_in_content``: one of :data:`SPECIAL_TOKENS_IN_CONTENT` (module docstring):
    ``text`` (default) tokenises special-token strings inside messages as plain text, ``special``
    as special tokens (the behaviour before this option existed). ``added_tokens_in_content``: one
    of :data:`ADDED_TOKENS_IN_CONTENT`: ``token`` (default) keeps the ids of non-special added
    tokens written in messages, ``text`` tokenises their strings as plain text (a fast tokenizer only).
    With ``over_length="truncate"``, a render longer than ``truncate_prefix_min_chars`` (an attribute,
    :data:`TRUNCATE_PREFIX_CHARS_PER_TOKEN` x ``max_length``) is tokenised by prefix (module docstring).

    Attributes: ``template_sha256`` (hex sha256 of the template text, for the run config);
    ``end_of_turn_ids`` (token ids that close an assistant reply: the special token the template
    writes after a reply, found by rendering a probe conversation, plus ``eos_token_id``);
    ``special_tokens`` (special-token string -> id: the added tokens marked special, which
    ``text`` mode keeps out of content); ``added_tokens`` (the same for added tokens not marked special);
    ``tokenised_chars`` (characters handed to the tokenizer so far) and ``prefix_fallbacks`` (renders
    whose prefix did not settle the sample, then tokenised whole).
    Raises BadConfig when the tokenizer has no chat template, no end-of-turn token is found,
    ``special_tokens_in_content`` or ``added_tokens_in_content`` is not a known mode, or
    ``added_tokens_in_content="text"`` is asked of a slow tokenizer.
    """

    def __init__(
        self,
        tokenizer,
        *,
        max_length: int,
        enable_thinking: bool | None = None,
        chat_template_kwargs: dict | None = None,
        over_length: str = "truncate",
        special_tokens_in_content: str = "text",
        added_tokens_in_content: str = "token",
    ):
        if special_tokens_in_content not in SPECIAL_TOKENS_IN_CONTENT:
            raise BadConfig(f"special_tokens_in_content={special_tokens_in_content!r}: choose one of "
                            f"{', '.join(SPECIAL_TOKENS_IN_CONTENT)}")
        if added_tokens_in_content not in ADDED_TOKENS_IN_CONTENT:
            raise BadConfig(f"added_tokens_in_content={added_tokens_in_content!r}: choose one of "
                            f"{', '.join(ADDED_TOKENS_IN_CONTENT)}")
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
        self.special_tokens_in_content = special_tokens_in_content
        self.added_tokens_in_content = added_tokens_in_content
        self.special_tokens = _special_tokens(tokenizer)
        self.added_tokens = {t: i for t, i in _added_tokens(tokenizer).items() if t not in self.special_tokens}
        if added_tokens_in_content == "text" and self.added_tokens and self._backend is None:
            raise BadConfig(f"added_tokens_in_content='text' needs a fast tokenizer; {type(tokenizer).__name__} is "
                            "slow: load the model's fast tokenizer or keep --added-tokens-in-content token")
        # The strings content may not hold as tokens: escaped by placeholders while the template renders.
        escaped = dict(self.special_tokens) if special_tokens_in_content == "text" else {}
        if added_tokens_in_content == "text":
            escaped.update(self.added_tokens)
        self._escape_re = (re.compile("|".join(re.escape(t) for t in sorted(escaped, key=len, reverse=True)))
                           if escaped else None)
        self._escaped = tuple(sorted(escaped))  # placeholder k stands for _escaped[k]
        self._placeholder_of = {t: k for k, t in enumerate(self._escaped)}
        # A render with placeholders is cut at every special token and every escaped string (all the
        # template's own there), so its pieces hold none of them.
        self._cut_ids = {**self.special_tokens, **escaped}
        self._cut = tuple(sorted(self._cut_ids))
        self._cut_re = _cut_pattern(tokenizer, self._cut)
        self._text_tokenizer = None  # built on first use (module docstring: content as text)
        self._text_lock = threading.Lock()
        #: Characters of renders and prompts handed to the tokenizer so far (all threads).
        self.tokenised_chars = 0
        #: Renders tokenised by prefix whose prefix did not settle the sample, so tokenised whole.
        self.prefix_fallbacks = 0
        self.end_of_turn_ids = self._probe_end_of_turn_ids()
        self._eot_array = np.array(sorted(self.end_of_turn_ids), dtype=np.int32)
        # Truncation by prefix (module docstring): renders longer than this many characters, with
        # over_length="truncate" and a tokenizer whose prefixes are known to tokenise exactly.
        self.truncate_prefix_min_chars = TRUNCATE_PREFIX_CHARS_PER_TOKEN * self.max_length
        self._prefix_ok = over_length == "truncate" and _prefix_tokenisable(tokenizer, self._backend)
        self._added_strings = tuple(sorted(_added_tokens(tokenizer)))
        # The end-of-turn tokens as strings, when each occurrence of one in a render is that token
        # and no other way gives its id (then they are counted in text); else None.
        added = _added_tokens(tokenizer)
        eot_strings = tuple(t for t, i in added.items() if i in self.end_of_turn_ids)
        self._eot_strings = (eot_strings if self._prefix_ok and len(eot_strings) == len(self.end_of_turn_ids)
                             and all(self._backend.model.id_to_token(i) is None for i in self.end_of_turn_ids)
                             and _never_overlap(added) else None)

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
        conv = self._prepare(record)
        if self._takes_prefix(conv):
            return self._encode_tokens(conv, *self._tokenise_prefix(conv.full, conv.esc, self.max_length + 1))
        ids, ends = self._tokenise(conv.full, with_offsets=True, esc=conv.esc)
        return self._encode_rendered(conv, ids, ends)

    def _takes_prefix(self, conv: "_Prepared") -> bool:
        """Whether ``conv``'s render is tokenised by prefix (module docstring, "Truncation by prefix")."""
        return self._prefix_ok and len(conv.full) > self.truncate_prefix_min_chars

    def _encode_tokens(self, conv: "_Prepared", ids: list[int], ends: np.ndarray | None, tail: int | None
                       ) -> TokenisedSample:
        """:meth:`_encode_rendered` of a render's tokens or of its prefix's tokens (``tail`` set),
        tokenising the render whole when the prefix does not settle the sample."""
        try:
            return self._encode_rendered(conv, ids, ends, tail)
        except _NeedFull:
            self.prefix_fallbacks += 1
            ids, ends = self._tokenise(conv.full, with_offsets=True, esc=conv.esc)
            return self._encode_rendered(conv, ids, ends)

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
                # Per item: _Prepared | BadRecord | TextRecord | PretokenisedRecord
                rendered: list = []
                for rec in chunk:
                    if not isinstance(rec, Conversation):
                        rendered.append(rec)
                        continue
                    try:
                        rendered.append(self._prepare(rec))
                    except BadRecord as err:
                        rendered.append(err)
                chats = [r for r in rendered if isinstance(r, _Prepared)]
                plain_texts = [r.text for r in rendered if isinstance(r, TextRecord)]
                future = pool.submit(self._tokenise_batch, chats, plain_texts)
                if pending is not None:
                    yield from self._finish_chunk(*pending)
                pending = (rendered, future)
            if pending is not None:
                yield from self._finish_chunk(*pending)

    def _tokenise_batch(self, chats: list["_Prepared"], plain_texts: list[str]) -> tuple[list, list]:
        """(ids, end offsets, tail) or BadRecord of each chat render, (ids, added-token flags) of each plain text.

        ``tail`` is None, or, for a render tokenised by prefix (:meth:`_tokenise_prefix`), where its
        untokenised rest starts.

        Renders whose content holds special-token strings (rare) take :meth:`_tokenise_escaped`, one
        by one; its BadRecord is returned in place, not raised, so the rest of the chunk goes on.
        """
        chat: list = [None] * len(chats)
        plain = [i for i, c in enumerate(chats) if c.esc is None and not self._takes_prefix(c)]
        if self._backend is not None and plain:
            texts = [chats[i].full for i in plain]
            self.tokenised_chars += sum(map(len, texts))
            encs = self._backend.encode_batch(texts, add_special_tokens=False)
            for i, e in zip(plain, encs):
                chat[i] = (e.ids, _end_offsets(e), None)
        for i, c in enumerate(chats):
            if chat[i] is None:
                try:
                    if self._takes_prefix(c):
                        chat[i] = self._tokenise_prefix(c.full, c.esc, self.max_length + 1)
                    else:
                        chat[i] = (*self._tokenise(c.full, with_offsets=True, esc=c.esc), None)
                except BadRecord as err:
                    chat[i] = err
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
                    tokens = next(chat_it)
                    if isinstance(tokens, BadRecord):
                        raise tokens
                    yield self._encode_tokens(item, *tokens)
            except BadRecord as err:
                yield err

    def _encode_rendered(self, conv: "_Prepared", ids: list[int], ends: np.ndarray | None,
                         tail: int | None = None) -> TokenisedSample:
        """The mask of a conversation whose full render ``conv.full`` tokenised to ``ids`` (end offsets
        ``ends``, in the real render's characters: the placeholders replaced by their strings).

        With ``tail`` (:meth:`_tokenise_prefix`), ``ids`` are only the render's first tokens (more
        than ``max_length``) and ``conv.full[tail:]`` holds every end-of-turn token after them: the
        mask of those tokens is what the whole row's would be, or :class:`_NeedFull` is raised.
        """
        rid, messages, full, esc = conv.record_id, conv.messages, conv.full, conv.esc
        ids_S = np.asarray(ids, dtype=np.int32)
        self._check_length(rid, ids_S.shape[0])  # before the prefix renders: a dropped row costs none
        eot_pos = np.flatnonzero(np.isin(ids_S, self._eot_array))
        loss_mask_S = np.zeros(ids_S.shape[0], dtype=np.uint8)
        partial = tail is not None

        prev_end = -1
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant" or (conv.supervised is not None and i not in conv.supervised):
                continue
            prompt = self._render(rid, messages[:i], conv.tools, add_generation_prompt=True)
            if ends is not None and full.startswith(prompt):
                # First token that is not entirely inside the prompt text (ends are non-decreasing).
                prompt_chars = len(prompt) if esc is None else len(esc.unescape(prompt))
                start = int(np.searchsorted(ends, prompt_chars, side="right"))
                if partial and start >= ids_S.shape[0]:
                    # The reply starts after the prefix's tokens, so after max_length: the whole row
                    # would give it an end-of-turn token iff the render has one after the prompt.
                    if self._eot_string_after(full, len(prompt)):
                        break
                    raise _NeedFull
            else:
                start = self._start_by_token_ids(rid, i, prompt, ids_S, eot_pos, esc, full if partial else None)
                if start is None:  # partial: the reply starts after the prefix, with its end-of-turn token
                    break
            if start <= prev_end:
                raise BadRecord(rid, "template_error",
                                f"assistant turn {i} would start at token {start}, inside the previous "
                                f"reply (ends at {prev_end}): the template's prefix renders do not line up")
            k = int(np.searchsorted(eot_pos, start, side="left"))
            if k >= eot_pos.shape[0] and partial:
                # The reply's end-of-turn token, if any, is after the prefix, so after max_length.
                if conv.unfinished and i in conv.unfinished or not self._eot_string_after(full, tail):
                    raise _NeedFull
                loss_mask_S[start:] = 1
                break
            if k >= eot_pos.shape[0]:
                raise BadRecord(rid, "template_error",
                                f"assistant turn {i}: no end-of-turn token {sorted(self.end_of_turn_ids)} "
                                f"after token {start} of {ids_S.shape[0]}")
            end = int(eot_pos[k])
            last = end if i not in conv.unfinished else self._unfinished_reply_end(conv, i, start, end, ends)
            loss_mask_S[start:last + 1] = 1
            prev_end = end
            if end >= self.max_length:
                break  # later replies are cut off by truncation: spare their prompt renders
        return self._sample(rid, ids_S, loss_mask_S)

    @staticmethod
    def _unfinished_reply_end(conv: "_Prepared", i: int, start: int, end: int, ends: np.ndarray | None) -> int:
        """Last supervised token of unfinished assistant turn i, whose reply starts at token ``start``
        and whose end-of-turn token is at ``end``: the token holding the last character of the turn's
        content (module docstring, step 3); ``end - 1`` when that cannot be told."""
        msg = conv.messages[i]
        content = msg.get("content")
        if ends is None or end <= start or msg.get("tool_calls") or not isinstance(content, str) or not content.strip():
            return end - 1
        full = conv.full
        if conv.esc is not None:  # offsets count characters of the real render
            content, full = conv.esc.unescape(content), conv.esc.unescape(full)
        lo, hi = (int(ends[start - 1]) if start > 0 else 0), int(ends[end - 1])
        for text in (content, content.lstrip(), content.rstrip(), content.strip()):  # as the template may strip it
            at = full.rfind(text, lo, hi)
            if at >= 0:
                # the token holding the content's last character: the first one ending after it
                last = int(np.searchsorted(ends, at + len(text) - 1, side="right"))
                return min(max(last, start), end - 1)
        return end - 1

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
            raise BadRecord(rid, "too_long", f"{num_tokens} tokens > --max-length {self.max_length} "
                            "(dropped: --drop-long; without it the sample is truncated)")

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
                            + (f" after truncation at --max-length {self.max_length}" if truncated else "")
                            + f"; need {MIN_CONSECUTIVE_SUPERVISED} consecutive")
        return TokenisedSample(record_id=rid, input_ids=ids_S, loss_mask=loss_mask_S, truncated=truncated)

    # ----------------------------------------------------------------------------------------

    def _prepare(self, conv: Conversation) -> "_Prepared":
        """The messages and tools as the template gets them, and their full render.

        In ``text`` mode, a conversation with a special-token string in any of its strings (all
        message fields but ``role``, and the tool definitions) gets them replaced by placeholders
        (:class:`_ContentEscape`); any other conversation is passed as it is.
        Raises BadRecord ``template_error`` when the template raises.
        """
        messages = list(conv.messages)
        tools = list(conv.tools) if conv.tools else None
        esc = None
        if self._escape_re is not None:
            strings = [s for m in messages for k, v in m.items() if k != "role" for s in _strings(v)]
            strings += [s for s in _strings(tools)]
            if any(self._escape_re.search(s) for s in strings):
                esc = _ContentEscape.for_strings(strings, self._escaped, conv.record_id)
                messages = [{k: (v if k == "role" else self._escape(v, esc)) for k, v in m.items()} for m in messages]
                tools = self._escape(tools, esc)
        full = self._render(conv.record_id, messages, tools, add_generation_prompt=False)
        bound = self._chars_per_token_bound() if self.over_length == "drop" and esc is None else None
        if bound and len(full) > self.max_length * bound:
            # dropped without tokenising it (a 30 MB record took 80 s and 5 GB to tokenise): too long for sure
            raise BadRecord(conv.record_id, "too_long",
                            f"its render has {len(full):,} characters, so more than {len(full) // bound:,} tokens "
                            f"(no token covers more than {bound} characters with this tokenizer) > "
                            f"--max-length {self.max_length} (dropped before tokenising: --drop-long; without it "
                            "the sample is truncated)")
        return _Prepared(conv.record_id, messages, tools, esc, full, conv.supervised_turns, conv.unfinished_turns)

    def _escape(self, value: Any, esc: "_ContentEscape") -> Any:
        """``value`` with each special-token string in its strings (dict keys too) replaced by its placeholder."""
        if isinstance(value, str):
            return self._escape_re.sub(lambda m: esc.placeholder(self._placeholder_of[m.group()]), value)
        if isinstance(value, dict):
            return {self._escape(k, esc): self._escape(v, esc) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._escape(v, esc) for v in value)
        return value

    _bound: int | None = None

    def _chars_per_token_bound(self) -> int:
        """Characters of text one token can cover at most with this tokenizer, or 0 when no bound
        is known: 4 x the UTF-8 bytes of its longest vocabulary string (a byte-level piece such as
        ``Ġ`` takes 2 bytes for the 1 byte it stands for, so this overstates; the 4: Unicode NFC
        composes at most 4 code points into one). Only for a tokenizer whose normalizer is none or
        NFC (others, such as strip-accents, may remove characters)."""
        if self._bound is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            normalizer = type(getattr(backend, "normalizer", None)).__name__ if backend is not None else "?"
            if normalizer in ("NoneType", "NFC"):
                self._bound = 4 * max(len(t.encode()) for t in self.tokenizer.get_vocab())
            else:
                self._bound = 0
        return self._bound

    def _render(self, rid: str, messages: list[dict], tools: list | None, *, add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt, **self._kwargs
            )
        except Exception as err:  # jinja raises anything (TemplateError, TypeError on None content...)
            raise BadRecord(rid, "template_error", f"{type(err).__name__}: {err}") from None

    def _tokenise(self, text: str, *, with_offsets: bool, esc: "_ContentEscape | None" = None
                  ) -> tuple[list[int], np.ndarray | None]:
        """Token ids of the render ``text`` (no special tokens added) and, from a fast tokenizer, end offsets.

        With ``esc`` (a render with placeholders), :meth:`_tokenise_escaped`.
        """
        if esc is not None:
            return self._tokenise_escaped(text, esc, with_offsets=with_offsets)
        self.tokenised_chars += len(text)
        if self._backend is not None:
            enc = self._backend.encode(text, add_special_tokens=False)
            return enc.ids, (_end_offsets(enc) if with_offsets else None)
        return self.tokenizer.encode(text, add_special_tokens=False), None

    def _tokenise_prefix(self, text: str, esc: "_ContentEscape | None", need: int
                         ) -> tuple[list[int], np.ndarray, int | None]:
        """(ids, end offsets, tail) of the render ``text``, or of as short a prefix of it as gives at
        least ``need`` tokens: the render's first ``len(ids)`` tokens exactly (module docstring,
        "Truncation by prefix"). ``tail`` is None when the whole render was tokenised, else the
        position in ``text`` where the untokenised rest starts: no end-of-turn token of the whole
        row that is not in ``ids`` comes from before it (a cut inside a piece of a render with
        placeholders gives the piece's start). The same BadRecord as :meth:`_tokenise`.
        """
        if esc is None:
            ids, ends, cut = self._encode_prefix(self._backend, text, need)
            return ids, ends, (cut if cut < len(text) else None)
        texts, specials, starts = self._escaped_pieces(text, esc)
        ids: list[int] = []
        ends: list[np.ndarray] = []
        chars = 0
        text_tokenizer = self._text_backend()
        for k, piece in enumerate(texts):
            if len(ids) >= need:
                return ids, np.concatenate(ends), starts[k][0]
            piece_ids, piece_ends, cut = self._encode_prefix(text_tokenizer, piece, need - len(ids))
            ids.extend(piece_ids)
            ends.append(piece_ends + chars)
            if cut < len(piece):
                return ids, np.concatenate(ends), starts[k][0]
            chars += len(piece)
            if k < len(specials):
                if len(ids) >= need:
                    return ids, np.concatenate(ends), starts[k][1]
                token_text, token_id = specials[k]
                ids.append(token_id)
                chars += len(token_text)
                ends.append(np.array([chars], dtype=np.int64))
        return ids, np.concatenate(ends), None

    def _encode_prefix(self, backend, text: str, need: int) -> tuple[list[int], np.ndarray, int]:
        """(ids, end offsets, cut) of ``text[:cut]`` with ``backend`` (no special tokens added): the
        whole text (``cut == len(text)``), or a prefix cut by :func:`_safe_cut` whose tokens, at least
        ``need`` of them, are the whole text's first tokens. The prefix starts at
        ``_PREFIX_START_CHARS_PER_TOKEN`` characters a token wanted and doubles until it gives enough."""
        size = max(_PREFIX_START_CHARS_PER_TOKEN * need, 256)
        while True:
            cut = _safe_cut(text, size, self._added_strings) if size < len(text) else len(text)
            self.tokenised_chars += cut
            enc = backend.encode(text[:cut] if cut < len(text) else text, add_special_tokens=False)
            if cut == len(text) or len(enc.ids) >= need:
                return enc.ids, _end_offsets(enc), cut
            size = 2 * cut

    def _eot_string_after(self, text: str, pos: int) -> bool:
        """Whether an end-of-turn token's string in the render ``text`` ends after ``pos`` (so the
        row has that token after the tokens that end by ``pos``); False when not countable in text."""
        return self._eot_strings is not None and any(
            text.find(t, max(0, pos - len(t) + 1)) >= 0 for t in self._eot_strings)

    def _count_eot(self, text: str) -> int:
        """End-of-turn tokens in the tokens of the render ``text``, counted in the text."""
        if self._eot_strings is None:
            raise _NeedFull
        return sum(text.count(t) for t in self._eot_strings)

    def _tokenise_escaped(self, rendered: str, esc: "_ContentEscape", *, with_offsets: bool
                          ) -> tuple[list[int], np.ndarray | None]:
        """Ids of a render whose content's special-token strings are placeholders: only the
        template's special tokens are special (module docstring).

        The render is cut at the special-token strings it holds (all the template's), each with the
        whitespace its ``lstrip`` / ``rstrip`` flags absorb; each piece between them, placeholders
        replaced by their strings, is tokenised with special tokens not recognised. End offsets
        count characters of the real render (``esc.unescape(rendered)``).

        Raises BadRecord ``template_error`` when a piece still holds the placeholder marker (the
        template altered a placeholder).
        """
        texts, specials, _ = self._escaped_pieces(rendered, esc)
        encoded = self._encode_as_text(texts, with_offsets=with_offsets)
        ids: list[int] = []
        ends: list[np.ndarray] = []
        chars = 0
        for k, (text, (piece_ids, piece_ends)) in enumerate(zip(texts, encoded)):
            ids.extend(piece_ids)
            if with_offsets:
                ends.append(piece_ends + chars)
            chars += len(text)
            if k < len(specials):
                token_text, token_id = specials[k]
                ids.append(token_id)
                chars += len(token_text)
                if with_offsets:
                    ends.append(np.array([chars], dtype=np.int64))
        return ids, (np.concatenate(ends) if with_offsets else None)

    def _escaped_pieces(self, rendered: str, esc: "_ContentEscape"
                        ) -> tuple[list[str], list[tuple[str, int]], list[tuple[int, int]]]:
        """The cut of :meth:`_tokenise_escaped`: the pieces' texts (placeholders replaced), the
        template's special tokens between them (text, id), and where each piece and the special
        token after it start in ``rendered``. Raises its BadRecord."""
        pieces, specials, starts, pos = [], [], [], 0
        for m in self._cut_re.finditer(rendered):
            pieces.append(rendered[pos:m.start()])
            specials.append((m.group(), self._cut_ids[self._cut[int(m.lastgroup[1:])]]))
            starts.append((pos, m.start()))
            pos = m.end()
        pieces.append(rendered[pos:])
        starts.append((pos, len(rendered)))
        texts = [esc.unescape(p) for p in pieces]
        marker = esc.marker.lower()
        for text in texts:
            if marker in text.lower():
                raise BadRecord(esc.record_id, "template_error",
                                f"the chat template altered the placeholder {esc.marker!r}... that stands for a "
                                "special-token (or added-token) string of the content; use --special-tokens-in-content "
                                "special (and --added-tokens-in-content token) to tokenise such strings as tokens instead")
        return texts, specials, starts

    def _encode_as_text(self, texts: list[str], *, with_offsets: bool) -> list[tuple[list[int], np.ndarray | None]]:
        """(ids, end offsets or None) of each text, special-token strings tokenised as plain text.

        A fast tokenizer: a copy of its Rust tokenizer with ``encode_special_tokens`` set, made once
        (the shared one is never switched: the tokenising thread of :meth:`encode_many` uses it
        meanwhile; ``tokenizer(..., split_special_tokens=True)`` on a fast tokenizer also leaves that
        flag set on it, as measured with transformers 5.24, so this code never passes it one). With
        ``added_tokens_in_content="text"`` the copy has the non-special added tokens marked special,
        so that flag leaves them unmatched too (``encode_special_tokens`` skips special ones only).
        A slow tokenizer: ``split_special_tokens=True``, no offsets.
        """
        self.tokenised_chars += sum(map(len, texts))
        if getattr(self.tokenizer, "backend_tokenizer", None) is None:
            return [(self.tokenizer.encode(t, add_special_tokens=False, split_special_tokens=True), None) for t in texts]
        encs = self._text_backend().encode_batch(texts, add_special_tokens=False)
        return [(e.ids, _end_offsets(e) if with_offsets else None) for e in encs]

    def _text_backend(self):
        """The copy of the Rust tokenizer that tokenises special-token strings as text (:meth:`_encode_as_text`);
        one per tokenizer and mode in a process (:data:`_TEXT_BACKENDS`: building it takes 1-2 s)."""
        backend = self.tokenizer.backend_tokenizer
        with self._text_lock:
            if self._text_tokenizer is None:
                key = (id(backend), self.added_tokens_in_content, tuple(sorted(self.added_tokens)))
                with _TEXT_BACKENDS_LOCK:
                    held = _TEXT_BACKENDS.get(key)
                    if held is None or held[0] is not backend:
                        held = (backend, self._build_text_backend(backend))
                        if len(_TEXT_BACKENDS) >= 8:
                            _TEXT_BACKENDS.clear()
                        _TEXT_BACKENDS[key] = held
                self._text_tokenizer = held[1]
        return self._text_tokenizer

    def _build_text_backend(self, backend):
        from tokenizers import Tokenizer

        spec = backend.to_str()
        if self.added_tokens_in_content == "text":
            raw = json.loads(spec)
            for token in raw.get("added_tokens", []):
                if token.get("content") in self.added_tokens:
                    token["special"] = True
            spec = json.dumps(raw)
        text_tokenizer = Tokenizer.from_str(spec)
        text_tokenizer.encode_special_tokens = True
        return text_tokenizer

    def _start_by_token_ids(self, rid: str, i: int, prompt: str, ids_S: np.ndarray, eot_pos: np.ndarray,
                            esc: "_ContentEscape | None" = None, full: str | None = None) -> int | None:
        """First reply token of assistant turn i when the prompt render is not a text prefix.

        The longest common prefix of token ids is right when only the tail of the prompt differs
        (a generation prompt with an empty think block). When the prompt differs earlier (the
        template rendered an earlier turn differently because it was last), the prompt is aligned
        on the full row by its end-of-turn count: its n-th end-of-turn token is the full row's
        n-th, and what follows (the generation prompt) is matched from there.

        With ``full`` (the render, when ``ids_S`` holds only its first tokens: truncation by
        prefix), the prompt is tokenised by prefix too; None when the reply starts after ``ids_S``
        and the whole row has an end-of-turn token after it (either way the row then has more
        end-of-turn tokens than the prompt); :class:`_NeedFull` when this is not settled.
        """
        n = ids_S.shape[0]
        if full is None:
            p_ids, _ = self._tokenise(prompt, with_offsets=False, esc=esc)
            p_whole = True
        else:
            p_ids, _, p_tail = self._tokenise_prefix(prompt, esc, n)
            p_whole = p_tail is None
        p_ids_P = np.asarray(p_ids, dtype=np.int32)
        lcp = _common_prefix_len(p_ids_P, ids_S)
        if full is not None and (lcp >= n or not p_whole):
            if lcp >= n and self._count_eot(full) > self._count_eot(prompt):
                return None
            raise _NeedFull
        p_eot = np.flatnonzero(np.isin(p_ids_P[lcp:], self._eot_array))
        if p_eot.shape[0] == 0:
            return lcp
        n_eot = int(np.isin(p_ids_P, self._eot_array).sum())
        if n_eot > eot_pos.shape[0]:
            if full is not None:
                raise _NeedFull
            raise BadRecord(rid, "template_error",
                            f"assistant turn {i}: the prompt render has {n_eot} end-of-turn tokens, "
                            f"the full render only {eot_pos.shape[0]}")
        last_p_eot = lcp + int(p_eot[-1])
        anchor = int(eot_pos[n_eot - 1]) + 1
        start = anchor + _common_prefix_len(p_ids_P[last_p_eot + 1:], ids_S[anchor:])
        if full is not None and start >= n:
            if self._count_eot(full) > n_eot:
                return None
            raise _NeedFull
        return start

    def _probe_end_of_turn_ids(self) -> frozenset[int]:
        """The special token the template writes right after an assistant reply, plus eos."""
        found: set[int] = set()
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int):
            found.add(eos)
        special = set(getattr(self.tokenizer, "all_special_ids", []))
        special.update(self.special_tokens.values())
        text = self._render("<probe>", _PROBE, None, add_generation_prompt=False)
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


@dataclass(frozen=True)
class _Prepared:
    """A conversation as the template got it: ``messages`` and ``tools`` (with placeholders when
    ``esc`` is set) and ``full``, their render without generation prompt."""

    record_id: str
    messages: list[dict]
    tools: list | None
    esc: "_ContentEscape | None"
    full: str
    supervised: frozenset[int] | None = None  # Conversation.supervised_turns
    unfinished: frozenset[int] = frozenset()  # Conversation.unfinished_turns


@dataclass(frozen=True)
class _ContentEscape:
    """Placeholders for the special-token strings of one conversation's content (module docstring).

    Placeholder k is ``f"{marker}q{k}q"`` and stands for ``specials[k]``; ``marker`` is
    ``hsxesc<n>`` with the smallest n that occurs (case-insensitively) in none of the record's
    strings, so every placeholder found in a render is one of ours. No proper prefix of
    ``hsxesc<n>q`` is also its suffix, so no occurrence can start in the text before a placeholder.
    """

    record_id: str
    marker: str
    specials: tuple[str, ...]

    @classmethod
    def for_strings(cls, strings: list[str], specials: tuple[str, ...], record_id: str = "") -> "_ContentEscape":
        lowered = [s.lower() for s in strings]
        n = 0
        while any(f"{_MARKER}{n}" in s for s in lowered):
            n += 1
        return cls(record_id, f"{_MARKER}{n}", specials)

    def placeholder(self, k: int) -> str:
        return f"{self.marker}q{k}q"

    def unescape(self, text: str) -> str:
        """``text`` with each placeholder replaced by the special-token string it stands for."""
        if self.marker not in text:
            return text
        return re.sub(re.escape(self.marker) + r"q(\d+)q", lambda m: self.specials[int(m.group(1))], text)


def _special_tokens(tokenizer) -> dict[str, int]:
    """Special-token string -> id: the added tokens marked special (what ``split_special_tokens=True``
    tokenises as text), and the tokenizer's named special tokens (bos, eos, pad...)."""
    out = {t.content: int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    for token in getattr(tokenizer, "all_special_tokens", []):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and token not in out and token:
            out[token] = tid
    return out


def _added_tokens(tokenizer) -> dict[str, int]:
    """Added-token string -> id of every added token, special or not (``<think>`` is 151667 in Qwen3)."""
    return {t.content: int(i) for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.content}


def _cut_pattern(tokenizer, specials: tuple[str, ...]) -> re.Pattern:
    """A regex matching each special-token string, with the whitespace it absorbs.

    An added token with ``lstrip`` (``rstrip``) takes the whitespace on its left (right) with it
    (the ``tokenizers`` library's ``AddedToken``); group ``t<k>`` matched ``specials[k]``. Longer
    strings first, so that one special-token string inside another is not cut out of it.
    """
    flags = {t.content: t for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    parts = []
    for k in sorted(range(len(specials)), key=lambda k: -len(specials[k])):
        token = flags.get(specials[k])
        left = r"\s*" if getattr(token, "lstrip", False) else ""
        right = r"\s*" if getattr(token, "rstrip", False) else ""
        parts.append(f"(?P<t{k}>{left}{re.escape(specials[k])}{right})")
    return re.compile("|".join(parts) if parts else r"(?!)")


def _strings(value: Any) -> Iterator[str]:
    """Every str inside ``value`` (nested dicts, their keys, lists and tuples)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(k)
            yield from _strings(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _strings(v)


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


# Truncation by prefix ---------------------------------------------------------------------------


class _NeedFull(Exception):
    """A render's prefix did not settle its sample exactly: tokenise the render whole (rare)."""


#: Code points whose pre-tokenizer class (``\p{L}``, ``\p{N}``, other) and NFC behaviour are known for
#: sure besides ASCII: long-assigned letters, digits and punctuation (Latin-1 and Latin Extended-A
#: letters, basic Greek and Cyrillic, CJK punctuation and brackets, kana, CJK unified ideographs of
#: Unicode 1.1, Hangul syllables, fullwidth ASCII). Each is a starter that NFC leaves as it is and
#: never composes with a character before it, so NFC of a text cut before one of them is the NFC of
#: the two sides. Anything else is never a side of a cut.
_KNOWN_RANGES = ((0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x17F), (0x391, 0x3A1), (0x3A3, 0x3A9), (0x3B1, 0x3C9),
                 (0x410, 0x44F), (0x3001, 0x3003), (0x3008, 0x3011), (0x3041, 0x3094), (0x30A1, 0x30FA),
                 (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFF01, 0xFF5E))
_KNOWN_CLASS = {"L": "L", "N": "N", "P": "P", "S": "P"}
_LETTERS = ("A-Za-z\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u017f\u0391-\u03a9\u03b1-\u03c9\u0410-\u044f\u3041-\u3094"
            "\u30a1-\u30fa\u4e00-\u9fa5\uac00-\ud7a3\uff21-\uff3a\uff41-\uff5a")
_DIGITS = "0-9\uff10-\uff19"
_PUNCT = "!-/:-@\\[-`{-~\u3001-\u3003\u3008-\u3011\uff01-\uff0f\uff1a-\uff20\uff3b-\uff40\uff5b-\uff5e"
#: A superset of the positions :func:`_safe_pair` accepts (the character after the cut), so that the
#: search skips runs (a megabyte of letters, spaces, ideographs or emoji) at regex speed.
_CUT_CANDIDATE = re.compile(
    f"(?<=[{_DIGITS}])[\\s\\S]|(?<=[{_LETTERS}{_PUNCT}])[{_DIGITS}]|(?<=[{_LETTERS}])[^{_LETTERS}]"
    f"|(?<=[{_PUNCT}])[ \\t]|(?<=[\\r\\n])[{_LETTERS}{_DIGITS}{_PUNCT}]")


def _char_class(ch: str) -> str | None:
    """The class of ``ch`` for the Qwen2 pre-tokenizer regex: ``L`` (``\\p{L}``), ``N`` (``\\p{N}``),
    ``P`` (neither, nor whitespace), ``R`` (``\\r``, ``\\n``), ``W`` (space, tab), or None (not known)."""
    o = ord(ch)
    if o < 0x80:
        if ch.isalpha():
            return "L"
        if ch.isdigit():
            return "N"
        if ch in "\r\n":
            return "R"
        if ch in " \t":
            return "W"
        return "P" if 0x21 <= o <= 0x7E else None
    for lo, hi in _KNOWN_RANGES:
        if lo <= o <= hi:
            return _KNOWN_CLASS.get(unicodedata.category(ch)[0])
    return None


def _safe_pair(x: str, y: str) -> bool:
    """True when a text cut between ``x`` and ``y`` is tokenised, before the cut, exactly as the
    whole text is (Qwen2 regex, NFC or no normalizer; module docstring). Every match of that regex
    ends where a run of its class ends; the match that holds ``x`` ends at the cut, and reads the
    same whether it meets ``y`` or the end of the text, when: ``x`` is a digit (always a pre-token of
    its own); ``y`` is a digit after a letter, digit or punctuation; ``x`` is a letter and ``y`` is
    not; ``x`` is punctuation and ``y`` a space or tab (``[\\r\\n]*`` would take a newline); ``x`` is a
    newline and ``y`` not whitespace. Never after whitespace: ``\\s+(?!\\S)`` reads the end of the text
    differently from a letter."""
    xc, yc = _char_class(x), _char_class(y)
    if xc is None or yc is None:
        return False
    if xc == "N":
        return True
    if yc == "N":
        return xc in ("L", "P")
    if xc == "L":
        return yc in ("P", "W", "R")
    if xc == "P":
        return y in " \t"
    if xc == "R":
        return yc in ("L", "P")
    return False


def _safe_cut(text: str, at: int, added: tuple[str, ...]) -> int:
    """The first cut point ``c >= at`` of ``text`` (``0 < c < len(text)``) before which the text
    tokenises exactly as the whole text does (:func:`_safe_pair`, and no added-token string spans
    it), or ``len(text)`` when there is none."""
    pos = max(at, 1)
    while (m := _CUT_CANDIDATE.search(text, pos)) is not None:
        c = m.start()
        if _safe_pair(text[c - 1], text[c]) and not any(
                0 <= text.find(s, max(0, c - len(s) + 1), c + len(s) - 1) < c for s in added):
            return c
        pos = c + 1
    return len(text)


def _prefix_tokenisable(tokenizer, backend) -> bool:
    """Whether a prefix of a render cut by :func:`_safe_cut` tokenises exactly as the render's first
    tokens with this tokenizer: a fast one with no or NFC normalizer, the Qwen2 pre-tokenizer regex
    then byte-level, BPE without dropout, a post-processor that adds nothing without special tokens
    and leaves offsets per token, no truncation or padding set, and added tokens without
    lstrip / rstrip / single_word / normalized flags. Anything else keeps whole tokenisation."""
    if backend is None:
        return False
    try:
        state = lambda part: None if part is None else json.loads(part.__getstate__())  # noqa: E731
        normalizer, pre, post = state(backend.normalizer), state(backend.pre_tokenizer), state(backend.post_processor)
        model = backend.model  # (its __getstate__ would serialise the whole vocabulary)
    except Exception:  # an unknown component: keep whole tokenisation
        return False
    split = {"type": "Split", "pattern": {"Regex": _QWEN2_SPLIT}, "behavior": "Isolated", "invert": False}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}
    return (
        (normalizer is None or normalizer.get("type") == "NFC")
        and isinstance(pre, dict) and pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 2
        and pre["pretokenizers"][0] == split
        and {k: pre["pretokenizers"][1].get(k) for k in byte_level} == byte_level
        and type(model).__name__ == "BPE" and getattr(model, "dropout", 1.0) in (None, 0.0)
        and (post is None or post.get("type") in ("TemplateProcessing", "ByteLevel"))
        and backend.truncation is None and backend.padding is None
        and not any(t.lstrip or t.rstrip or t.single_word or t.normalized
                    for t in getattr(tokenizer, "added_tokens_decoder", {}).values())
    )


def _never_overlap(strings: Iterable[str]) -> bool:
    """No occurrence of one of ``strings`` can overlap or hold another occurrence (no string holds
    another, no proper suffix of one is a prefix of one): then every occurrence in a text is a token."""
    strings = [s for s in strings if s]
    for a in strings:
        for b in strings:
            if a != b and b in a:
                return False
            if any(b.startswith(a[k:]) for k in range(1, len(a))):
                return False
    return True
