"""Tokenising on every core: records in dataset order -> samples or skips, in the same order.

The records are checked (``producer/datasets.py`` ``_normalise``), rendered with the chat template,
tokenised and given their loss masks (``producer/masks.py``) in ``num_proc`` worker processes
(``spawn``: a fresh interpreter each, no state forked from the planner's threads), each with its
own :class:`~producer.masks.ChatTokeniser` built from the same :class:`TokeniserSpec`. The planner
process only reads the records, checks ids for duplicates (that needs every earlier id) and puts
the results in order. ``num_proc=1`` runs the same functions in the planner process. Each result
depends only on its record, so the plan is the same whatever ``num_proc`` is.

Memory stays bounded: at most :data:`IN_FLIGHT_PER_PROC` chunks of :data:`CHUNK_RECORDS` records per
process are read ahead of the results.
"""

from __future__ import annotations

import logging
import multiprocessing
import importlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from hsx.errors import BadRecord
from producer.datasets import SkipCounter, _normalise, parse_raw

log = logging.getLogger(__name__)

#: Records sent to a worker process at a time.
CHUNK_RECORDS = 128
#: Chunks in flight per worker process (read ahead of the results).
IN_FLIGHT_PER_PROC = 3


@dataclass(frozen=True)
class TokeniserSpec:
    """What a process needs to build the planner's :class:`~producer.masks.ChatTokeniser` (picklable).

    ``chat_template``: the template text that replaces the tokenizer's (``--chat-template``), or None.
    """

    model: str
    cache_dir: str
    trust_remote_code: bool
    max_length: int
    enable_thinking: bool | None
    over_length: str
    special_tokens_in_content: str
    allow_text: bool
    chat_template: str | None = None
    added_tokens_in_content: str = "token"

    def build(self, tokenizer=None):
        """The tokenizer (unless given: :func:`shared_tokenizer`'s, shared with this process's other
        builds of the same model, files and template, so never to be changed) and its ChatTokeniser.
        Raises BadConfig."""
        from producer.masks import ChatTokeniser

        if tokenizer is None:
            tokenizer = shared_tokenizer(self.model, Path(self.cache_dir), trust_remote_code=self.trust_remote_code,
                                         chat_template=self.chat_template)
        return tokenizer, ChatTokeniser(tokenizer, max_length=self.max_length, enable_thinking=self.enable_thinking,
                                        over_length=self.over_length,
                                        special_tokens_in_content=self.special_tokens_in_content,
                                        added_tokens_in_content=self.added_tokens_in_content)


#: Tokenizers :func:`shared_tokenizer` loaded in this process, most recently used last: key -> tokenizer.
_TOKENIZERS: "OrderedDict[tuple, object]" = OrderedDict()
_TOKENIZERS_LOCK = threading.Lock()
#: Tokenizers kept at most (each ~30 MB for a 150k vocabulary); the least recently used goes first.
TOKENIZER_CACHE_SIZE = 4


def _files_signature(directory: Path) -> tuple:
    """``(relative path, size, mtime_ns, inode, ctime_ns)`` of every file in ``directory`` and its
    immediate subdirectories (``additional_chat_templates/``), sorted; symlinks followed (a hub
    snapshot's links to blobs). What :func:`shared_tokenizer` compares to know the files unchanged."""
    out = []
    for entry in os.scandir(directory):
        entries = [entry]
        if entry.is_dir():
            try:
                entries = list(os.scandir(entry.path))
            except OSError:
                entries = []
        for e in entries:
            try:
                st = os.stat(e.path)
            except OSError:  # a dangling link: part of the key as such
                out.append((os.path.relpath(e.path, directory), None))
                continue
            if not os.path.isdir(e.path):
                out.append((os.path.relpath(e.path, directory), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns))
    return tuple(sorted(out, key=lambda t: t[0]))


def shared_tokenizer(model: str, cache_dir: Path, *, trust_remote_code: bool = False,
                     chat_template: str | None = None):
    """The tokenizer of ``model`` (:func:`hsx.models.load_tokenizer`) with ``chat_template`` in place of
    its own when given, loaded once per process for the same files: callers share it and must not
    change it (its chat template, tokens, padding or truncation settings).

    Why: loading a tokenizer builds its vocabulary in Rust again (~0.2-0.4 CPU-s for Qwen's 151k
    tokens; a copy costs as much), and a process that plans several times (the tests, a worker's
    regenerate runs) paid it at every plan. Sharing is safe because its users only read it: the
    ChatTokeniser calls the Rust tokenizer's ``encode`` / ``encode_batch`` and renders templates; the
    wrapper's own ``encode`` sets no truncation, padding or special-token splitting on a fast
    tokenizer that is not already set (``split_special_tokens=True`` is used for slow ones only, which
    have no Rust backend).

    The key: the model's resolved local directory (``resolve_model_path``), the size, mtime, inode and
    ctime of every file in it (:func:`_files_signature`: a file rewritten, added or removed loads the
    tokenizer again), and the template. A hub id (no local directory) and ``trust_remote_code`` (code
    that may keep state) are not cached: each call loads, as :func:`~hsx.models.load_tokenizer` does.
    At most :data:`TOKENIZER_CACHE_SIZE` are kept. Thread-safe (one load at a time).

    Raises:
        BadConfig: the model or its tokenizer cannot be loaded (as :func:`~hsx.models.load_tokenizer`);
            nothing is cached then.
    """
    from hsx.models import load_tokenizer, resolve_model_path

    def load():
        tokenizer = load_tokenizer(model, cache_dir, trust_remote_code=trust_remote_code)
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        return tokenizer

    if trust_remote_code:
        return load()
    path = resolve_model_path(model, cache_dir)
    if not os.path.isdir(path):
        return load()
    with _TOKENIZERS_LOCK:
        key = (os.path.realpath(path), _files_signature(Path(path)), chat_template)
        tokenizer = _TOKENIZERS.get(key)
        if tokenizer is not None:
            _TOKENIZERS.move_to_end(key)
            return tokenizer
        tokenizer = load()
        _TOKENIZERS[key] = tokenizer
        while len(_TOKENIZERS) > TOKENIZER_CACHE_SIZE:
            _TOKENIZERS.popitem(last=False)
        return tokenizer


@dataclass
class Outcome:
    """What one record became.

    ``claimed``: the id the record claims (it passed the record checks), or None; ``sample``:
    ``(input_ids int32 [S], loss_mask uint8 [S], truncated)`` or None; ``skip``: the BadRecord
    when it became no sample; ``fixes``: repairs made to it (``leading_assistant_dropped``).
    """

    claimed: str | None
    sample: tuple[np.ndarray, np.ndarray, bool] | None
    skip: BadRecord | None
    fixes: tuple[str, ...] = ()


_CHAT = None  # this process's ChatTokeniser (worker processes: built by _init)
_ALLOW_TEXT = False


def _exit_with_parent(parent: int, every_s: float = 1.0) -> None:
    """A daemon thread of a tokenising process that ends it (``os._exit``) once the planner ``parent``
    is gone: a planner killed with SIGKILL runs no shutdown, and its processes (in a pool, in their
    own loop) were left running, a new user found them minutes later. Polled, not
    ``PR_SET_PDEATHSIG``: that follows the thread that started the process, and the pool may start
    them from a thread that ends before the planner does."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(0)

    threading.Thread(target=watch, name="hsx-exit-with-parent", daemon=True).start()


def _init(spec: TokeniserSpec, saved: tuple[str, str, str] | None = None, parent: int | None = None) -> None:
    global _CHAT, _ALLOW_TEXT
    if parent is not None:
        _exit_with_parent(parent)
    # Ctrl-C (and a closed terminal's SIGHUP) reach the whole process group: the planner stops the
    # processes (one line, not a traceback from each of them)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a closed terminal: the same
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    _CHAT = spec.build(_load_saved(saved))[1]
    _ALLOW_TEXT = spec.allow_text


def _load_saved(saved: tuple[str, str, str] | None):
    """The planner's tokenizer as it saved it (``save_pretrained``): ``(module, class name, directory)``,
    loaded with its own class. Not through AutoTokenizer: transformers' config code that it runs
    imports torch (~3 s and ~130 MB more per process). None (the process then loads the model's
    tokenizer as the planner did) when there is none or its class cannot be imported here."""
    if saved is None:
        return None
    module, name, directory = saved
    try:
        cls = getattr(importlib.import_module(module), name)
        return cls.from_pretrained(directory)
    except Exception:  # e.g. a remote-code class: spec.build() loads it the planner's way
        return None


def encode_chunk(items: list[tuple[str, object]], chat=None, allow_text: bool | None = None
                 ) -> tuple[list[Outcome], np.ndarray, np.ndarray]:
    """The :class:`Outcome` of each ``(fallback_id, raw record, BadRecord or RawLine)``, in order.

    Runs in a worker process (``chat`` None: the process's own) or in the planner (``num_proc=1``).
    Returns the outcomes without their arrays, and the samples' ``input_ids`` (int32 [T]) and
    ``loss_mask`` (uint8 [T]) concatenated in order: one array each per chunk crosses the process
    boundary, not two per record. :func:`split_chunk` puts them back on the outcomes.
    """
    chat = _CHAT if chat is None else chat
    allow_text = _ALLOW_TEXT if allow_text is None else allow_text
    out: list[Outcome | None] = [None] * len(items)
    records, where = [], []
    lines: list[int | None] = [None] * len(items)  # a JSON-lines record's line, for its skip's example
    for k, (fallback_id, raw) in enumerate(items):
        lines[k] = getattr(raw, "lineno", None)
        raw = parse_raw(raw)
        if isinstance(raw, BadRecord):  # a line that did not parse
            out[k] = Outcome(None, None, raw)
            continue
        local = SkipCounter()
        try:
            record = _normalise(raw, fallback_id, local, allow_text=allow_text)
        except BadRecord as err:
            out[k] = Outcome(None, None, err.at_line(lines[k]))
            continue
        out[k] = Outcome(record.record_id, None, None, tuple(name for name, n in local.fixes.items() for _ in range(n)))
        records.append(record)
        where.append(k)
    ids, masks = [], []
    for k, result in zip(where, chat.encode_many(records, chunk_records=max(1, len(records)))):
        if isinstance(result, BadRecord):
            out[k].skip = result.at_line(lines[k])
        else:
            ids.append(result.input_ids)
            masks.append(result.loss_mask)
            out[k].sample = (result.num_tokens, bool(result.truncated))  # the arrays travel concatenated
    ids_T = np.concatenate(ids).astype(np.int32, copy=False) if ids else np.zeros(0, np.int32)
    mask_T = np.concatenate(masks).astype(np.uint8, copy=False) if masks else np.zeros(0, np.uint8)
    return out, ids_T, mask_T  # type: ignore[return-value]


def split_chunk(result: tuple[list[Outcome], np.ndarray, np.ndarray]) -> list[Outcome]:
    """The outcomes of :func:`encode_chunk` with their ``sample`` as ``(input_ids [S], loss_mask [S],
    truncated)``: views into the chunk's concatenated arrays."""
    outcomes, ids_T, mask_T = result
    at = 0
    for o in outcomes:
        if o.sample is not None:
            n, truncated = o.sample
            o.sample = (ids_T[at:at + n], mask_T[at:at + n], truncated)
            at += n
    return outcomes


def default_num_proc() -> int:
    """The machine's cores available to this process (``sched_getaffinity``; a container's CPU set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class Tokenisers:
    """``num_proc`` tokenising processes (or none for 1); :meth:`map` keeps the input order.

    Use as a context manager: the processes are stopped on exit (Ctrl-C included).
    """

    def __init__(self, spec: TokeniserSpec, num_proc: int, chat=None):
        self.spec = spec
        self.num_proc = max(1, int(num_proc))
        self._chat = chat  # the planner's ChatTokeniser: used in-process, and its tokenizer sent to the processes
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Tokenisers":
        self._saved_dir = None
        if self.num_proc > 1:
            saved = None
            if self._chat is not None:
                tokenizer = self._chat.tokenizer
                self._saved_dir = tempfile.mkdtemp(prefix="hsx-tokenizer-")
                try:
                    tokenizer.save_pretrained(self._saved_dir)
                    saved = (type(tokenizer).__module__, type(tokenizer).__qualname__, self._saved_dir)
                except Exception:  # each process then loads the model's tokenizer itself
                    saved = None
            self._pool = ProcessPoolExecutor(self.num_proc, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_init, initargs=(self.spec, saved, os.getpid()))
        elif self._chat is None:
            self._chat = self.spec.build()[1]
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            # cancel what is queued; a Ctrl-C reached the workers too (same process group) and they exit
            self._pool.shutdown(wait=exc[0] is None, cancel_futures=True)
            self._pool = None
        if self._saved_dir is not None:
            shutil.rmtree(self._saved_dir, ignore_errors=True)

    def map(self, items: Iterable[tuple[str, object]]) -> Iterator[tuple[tuple[str, object], Outcome]]:
        """``(item, outcome)`` for each item, in input order; at most a few chunks read ahead."""
        it = iter(items)
        if self._pool is None:
            while chunk := list(islice(it, CHUNK_RECORDS)):
                yield from zip(chunk, split_chunk(encode_chunk(chunk, self._chat, self.spec.allow_text)))
            return
        pending: deque[tuple[list, Future]] = deque()
        limit = self.num_proc * IN_FLIGHT_PER_PROC
        exhausted = False
        while True:
            while not exhausted and len(pending) < limit:
                chunk = list(islice(it, CHUNK_RECORDS))
                if not chunk:
                    exhausted = True
                    break
                pending.append((chunk, self._pool.submit(encode_chunk, chunk)))
            if not pending:
                return
            chunk, fut = pending.popleft()
            yield from zip(chunk, split_chunk(fut.result()))
