"""Regenerate runs (issue 23): the assistant turns of a dataset answered again by the target.

A regenerate run is a run like an extraction run (``hsx/plan.py``, ``hsx/records.py``): the same
plan (token-budget batches of the dataset's conversations, streamed in windows), one shard per
batch, the marker last with a conditional create, the same leases, status and Ctrl-C. What differs:

- ``run.json`` has ``regenerate`` (:class:`RegenConfig` as a dict; ``None`` for extraction), which
  is part of the run's identity, so other generation options give another run id (greedy decoding
  leaves ``seed``, ``top_p`` and ``top_k`` out of it, and a regenerate run's identity leaves out the
  extraction-only ``layers`` and ``store_dtype``: ``hsx.runconfig.regen_identity``);
- beside each batch's plan file the planner writes ``plan/regen/<batch>.jsonl``
  (:func:`regen_plan_key`): one :class:`PlannedConversation` per sample of the batch, in the
  batch's sample order (the worker renders the prompts from them with the run's chat template);
- the shard is JSON lines, ``shards/<batch>-<attempt>.jsonl`` (:func:`regen_shard_key`): one
  :class:`RegeneratedConversation` per sample, a conversation any dataset reader of hsx reads
  (``{"id", "messages", "tools"}``) plus what was regenerated (``regenerated``: per answered turn,
  its index in ``messages``, the finish reason and the prompt and completion token counts);
- the marker is a :class:`RegenMarker`: a :class:`hsx.records.Marker` with the engine that
  answered (``engine``) and the generated token count (``completion_tokens``).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hsx.errors import BadConfig, BadPlan
from hsx.layout import SHARDS_PREFIX
from hsx.records import Marker

#: Prefix of the conversations of a regenerate plan: ``plan/regen/<batch>.jsonl``.
REGEN_PLAN_PREFIX = "plan/regen/"
#: Which assistant turns are answered: the last one of each conversation (the messages after it are
#: dropped), or every one in order, each prompt holding the answers regenerated before it.
TURNS = ("last", "all")
#: Why an answer ended. ``stop``: the model ended its turn (an end-of-turn or EOS token);
#: ``stop_string``: a ``--stop`` string was generated (the text is cut before it); ``length``: cut at
#: ``max_new_tokens`` (unfinished: ``--drop-unfinished`` skips such conversations downstream);
#: ``prompt_too_long``: the prompt alone exceeds the run's ``max_length`` (nothing generated).
FINISH_REASONS = ("stop", "stop_string", "length", "prompt_too_long")
#: The finish reasons of an answer that is complete.
FINISHED = frozenset({"stop", "stop_string"})
#: The finish reasons of an answer whose end-of-turn token the target did not generate (cut at
#: ``max_new_tokens``, or cut before a ``--stop`` string, where the target went on with the string):
#: the extraction of a regenerate run supervises such an answer through its last token only.
NO_END_OF_TURN = frozenset({"length", "stop_string"})


def regen_plan_key(batch: str) -> str:
    """``plan/regen/<batch>.jsonl``: the conversations of one batch of a regenerate plan."""
    return f"{REGEN_PLAN_PREFIX}{batch}.jsonl"


def regen_shard_key(batch: str, attempt: str) -> str:
    """``shards/<batch>-<attempt>.jsonl``: one attempt's regenerated conversations (the marker names the one that counts)."""
    return f"{SHARDS_PREFIX}{batch}-{attempt}.jsonl"


class RegenConfig(BaseModel):
    """``run.json`` ``regenerate``: how the answers are generated (in the run's identity;
    ``seed``, ``top_p`` and ``top_k`` only when sampling: ``hsx.runconfig.regen_identity``).

    ``temperature`` 0 is greedy decoding (``top_p``/``top_k`` unused); above 0, sampling from the
    softmax of ``logits / temperature`` restricted to the ``top_k`` most likely tokens (0: all) and
    to the smallest set whose probability reaches ``top_p`` (1.0: all), the order of transformers'
    warpers. ``seed``: each answer is sampled with its own generator, seeded by :func:`sample_seed`
    from this seed, the record id and the turn, so a retried batch (or one planned into other
    batches) regenerates the same text on the same device and engine. ``stop``: strings that end an
    answer (cut before the string). ``chat_template``: the text of ``--chat-template`` (None: the
    tokenizer's template), which the worker renders the prompts with.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    turns: Literal["last", "all"] = "last"
    chat_template: str | None = Field(default=None, repr=False)

    def check(self) -> "RegenConfig":
        """Return self; raises BadConfig naming the option, its value and the rule."""
        if self.max_new_tokens < 1:
            raise BadConfig(f"--max-new-tokens {self.max_new_tokens}: must be at least 1 token")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise BadConfig(f"--temperature {self.temperature}: must be a finite number >= 0 (0: greedy decoding)")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise BadConfig(f"--top-p {self.top_p}: must be a finite number in (0, 1] (1: no nucleus cut)")
        if self.top_k < 0:
            raise BadConfig(f"--top-k {self.top_k}: must be >= 0 (0: no top-k cut)")
        if self.seed < 0:
            raise BadConfig(f"--seed {self.seed}: must be >= 0")
        if any(not s for s in self.stop):
            raise BadConfig("--stop '': a stop string must not be empty")
        return self

    @classmethod
    def of(cls, config) -> "RegenConfig":
        """The generation options of a run config (``hsx.runconfig.RunConfig``).

        Raises BadPlan when the run is not a regenerate run or its ``regenerate`` cannot be read."""
        raw = getattr(config, "regenerate", None)
        if raw is None:
            raise BadPlan(f"run {getattr(config, 'run_id', '?')} is not a regenerate run (run.json has no 'regenerate')")
        try:
            return cls.model_validate(raw)
        except Exception as exc:  # pydantic.ValidationError
            raise BadPlan(f"run {getattr(config, 'run_id', '?')}: run.json 'regenerate' is not readable ({exc}); "
                          "it was written by another version of hsx") from None


def is_regenerate(config) -> bool:
    """True when ``config`` (a RunConfig) is a regenerate run's."""
    return getattr(config, "regenerate", None) is not None


def refuse_regenerate_run(config, address: str) -> None:
    """Raise BadConfig when ``config`` is a regenerate run's: what reads hidden states (``export``,
    ``vocab-counts``, the readers) has none to read there."""
    if is_regenerate(config):
        done = _extractions_beside(config.run_id, address)
        if done:
            raise BadConfig(f"{address} is a regenerate run (regenerated conversations, no hidden states); its "
                            f"extraction is {done[0]}: give that address instead")
        raise BadConfig(f"{address} is a regenerate run (regenerated conversations, no hidden states): extract it "
                        f"first with `python -m producer run {address} --model ...`")


def _extractions_beside(run_id: str, address: str) -> list[str]:
    """Extraction runs of the regenerate run ``run_id`` next to it in a local store (``producer run
    --regenerate`` writes them as ``<output>/<run_id>-<hash>``), newest first; [] for S3."""
    import json
    from pathlib import Path

    from hsx.storeurl import parse_store_url

    try:
        where = parse_store_url(address)
    except Exception:
        return []
    if not where.is_local:
        return []
    found = []
    for run_json in Path(where.path).parent.glob(f"{run_id}-*/run.json"):
        try:
            dataset = json.loads(run_json.read_text()).get("dataset") or {}
        except (OSError, ValueError):
            continue
        if dataset.get("kind") == "regenerate_run" and dataset.get("run_id") == run_id:
            found.append((run_json.stat().st_mtime, str(run_json.parent)))
    return [path for _, path in sorted(found, reverse=True)]


def sample_seed(seed: int, record_id: str, turn: int) -> int:
    """The generator seed of one answer: the first 8 bytes of sha256(``seed``, ``record_id``, ``turn``),
    as a non-negative int64. It depends on nothing else (not the batch, the worker or the attempt)."""
    digest = hashlib.sha256(f"{int(seed)}\x00{record_id}\x00{int(turn)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PlannedConversation(BaseModel):
    """One line of ``plan/regen/<batch>.jsonl``: a sample of the plan as the planner normalised it
    (``producer.datasets.Conversation``: roles ``system``/``user``/``assistant``/``tool``, at least one
    assistant turn)."""

    model_config = ConfigDict(extra="ignore")

    sample_index: int
    record_id: str
    messages: list[dict]
    tools: list[dict] | None = None


class Answer(BaseModel):
    """What was regenerated for one assistant turn. ``turn``: its index in the conversation's ``messages``;
    ``finish_reason``: one of :data:`FINISH_REASONS`; ``prompt_tokens`` / ``completion_tokens``: token
    counts of the rendered prompt and of the answer (through the end-of-turn token when it stopped)."""

    turn: int
    finish_reason: Literal["stop", "stop_string", "length", "prompt_too_long"]
    prompt_tokens: int
    completion_tokens: int

    @model_validator(mode="after")
    def _has_tokens(self) -> "Answer":
        # "stop" counts its end-of-turn token and "length" its --max-new-tokens: never 0. Workers before
        # 2026-12-03 recorded continuous batching's failed requests (no tokens) as "stop" answers.
        if self.finish_reason in ("stop", "length") and self.completion_tokens < 1:
            raise ValueError(f"turn {self.turn}: a '{self.finish_reason}' answer of {self.completion_tokens} tokens is "
                             "an engine's failed request, not an answer ('producer reconcile --repair' redoes its batch)")
        return self


class RegeneratedConversation(BaseModel):
    """One line of a regenerate shard: the conversation with its answers regenerated.

    ``id``: the original record's id; ``messages``: the original messages up to and with the last
    answered turn, each answered assistant turn's ``content`` (and ``reasoning_content``, when the
    answer held a ``<think>`` block) replaced by the target's answer; ``regenerated``: one
    :class:`Answer` per answered turn, in turn order; ``finished``: at least one turn was answered and
    every answer is complete (:data:`FINISHED`). A turn whose prompt does not fit in the run's
    ``max_length`` (``prompt_too_long``) is not answered: the messages end before it (with ``--turns
    last``, the last assistant turn whose prompt fits is the one answered). A conversation with no
    answered turn keeps its original messages and is never read as a dataset
    (:class:`producer.regenerate.RegeneratedSource` skips it as ``not_regenerated``).
    """

    model_config = ConfigDict(extra="ignore")

    id: str
    sample_index: int
    messages: list[dict]
    tools: list[dict] | None = None
    regenerated: list[Answer]
    finished: bool

    def to_line(self) -> bytes:
        return (json.dumps(self.model_dump(mode="json", exclude_none=True), ensure_ascii=False, sort_keys=True)
                + "\n").encode()


def parse_lines(data: bytes, model: type[BaseModel], what: str) -> list:
    """The JSON lines of ``data`` as ``model`` objects. Raises BadPlan naming ``what`` and the line."""
    out = []
    for n, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(model.model_validate_json(line))
        except Exception as exc:  # pydantic.ValidationError, ValueError
            raise BadPlan(f"{what}: line {n} is not a {model.__name__} ({str(exc)[:300]}); the file was damaged "
                          "after it was written: plan the run again into a new output") from None
    return out


class RegenMarker(Marker):
    """The marker of a regenerate batch: :class:`hsx.records.Marker` (``num_samples``: conversations in
    the shard; ``num_tokens``: their prompt and completion tokens; ``supervised_tokens``: the completion
    tokens) with the engine that answered, the unfinished count and the count cut by a stop string.
    Readers of plain markers ignore the extra fields."""

    engine: str | None = None
    """``continuous_batching`` (transformers' ``generate_batch``) or ``generate`` (batched, left padding)."""
    unfinished: int | None = None
    """Conversations of the shard with an answer cut at ``max_new_tokens`` (or a prompt too long)."""
    stop_cut: int | None = None
    """Conversations of the shard with an answer cut before a ``--stop`` string (``stop_string``: finished,
    but its end-of-turn token is not the target's; None in markers written before 2026-12-06)."""
