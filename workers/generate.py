"""One batch of a regenerate run (``hsx/regen.py``), on a worker: answer, write, certify.

The task is the extraction task (``hsx.queue.EXTRACT_TASK``): :func:`workers.extract.extract_batch`
admits the message exactly as for extraction (the allow-list, the marker, run.json, cancel, the
batch's plan, the worker's model) and hands a regenerate run's batch to :func:`regenerate_batch`.
One task name for both kinds on purpose: every path that sends a batch again (the reclaimer of
``workers/lease.py``, ``producer reconcile``, parked messages coming back) sends it by that one
name, and the run's ``run.json`` says what the batch is. The worker loads the target once
(``workers.target.get_target``) and serves both kinds with it.

- **prompts**: the batch's conversations (``plan/regen/<batch>.jsonl``, in the plan's sample
  order) rendered with the run's chat template and tokenised as the planner tokenises them
  (``producer.masks.ChatTokeniser``: content's special-token strings as text, ``enable_thinking``),
  with the generation prompt. ``--turns last``: the messages before the last assistant turn;
  ``--turns all``: one round per assistant turn, each prompt holding the answers of the rounds before.
- **answer**: under the GPU lock, by one of two engines (:func:`pick_engine`; the choice is logged
  once per process and recorded in the marker's ``engine``):

  - ``continuous_batching``: transformers' ``model.generate_batch`` (paged attention, continuous
    batching), for greedy decoding (``--temperature 0``) of a target whose every layer is
    attention (transformers 5.24's paged cache knows ``full_attention`` and ``sliding_attention``
    layers only: ``generation/continuous_batching/cache.py`` ``group_layers_by_attn_type`` raises on
    a Gated DeltaNet model's ``linear_attention``). It samples from one shared generator, so it is
    not used with sampling: a per-answer seed could not be honoured. One manager (and paged cache),
    sized for the run's batches, serves every batch of a run (:func:`generate_continuous`); an
    extraction batch on the same worker drops it first (:func:`release_continuous_batching`).
  - ``generate``: ``model.generate`` on the batch's prompts left-padded with an attention mask (left
    padding needs the mask: docs/FACTS.md §2), greedy, with temperature / top-k / top-p as
    transformers' own warpers and the sample drawn by the Gumbel-max trick from a generator per
    answer (:class:`SeededGumbel`): ``argmax(logits + Gumbel noise)`` is a sample of
    ``softmax(logits)``, and each answer's noise comes from its own seed
    (:func:`hsx.regen.sample_seed`), whatever else shares its batch.

  vLLM is not wired in (not installed where this was built; README, "Regenerating the responses").
- **write / certify**: the shard (JSON lines, ``shards/<batch>-<attempt>.jsonl``) through the
  store with the same waits for a full store, then a :class:`hsx.regen.RegenMarker` with the
  conditional create; a lost race deletes our shard (``workers/extract.py`` does the same).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from datetime import datetime, timezone

import torch

from hsx.access import ModelNotServed
from hsx.errors import BadPlan, RunCancelled, StoreError
from hsx.records import MarkerWorker, ShardRef
from hsx.regen import (FINISHED, Answer, PlannedConversation, RegenConfig, RegeneratedConversation, RegenMarker,
                       parse_lines, regen_plan_key, regen_shard_key, sample_seed)
from settings import Settings
from workers import faults

log = logging.getLogger(__name__)

#: Engine names, as logged and recorded in the marker.
CONTINUOUS = "continuous_batching"
GENERATE = "generate"
#: Layer types transformers' paged cache serves (``continuous_batching/cache.py``).
_PAGED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})

_chats: dict[str, object] = {}
_chats_lock = threading.Lock()
_said_engine: set[tuple[str, str]] = set()


class SeededGumbel:
    """A logits processor (transformers' ``LogitsProcessor`` protocol) that adds Gumbel noise drawn
    from one CPU generator per row, seeded with ``seeds[row]``.

    After transformers' temperature / top-k / top-p warpers (filtered tokens at -inf), greedy
    decoding of ``scores + noise`` samples each row from the warped softmax (the Gumbel-max
    trick). A row draws ``vocab`` uniforms per step from its own generator, so its answer does not
    depend on the other rows of the batch. ``scores``: float [B, V]; returns the same shape and dtype.
    """

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator(device="cpu").manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        V = scores.shape[-1]
        u = torch.stack([torch.rand(V, generator=g, dtype=torch.float64) for g in self.generators])
        gumbel = -torch.log(-torch.log(u.clamp(min=1e-300, max=1.0 - 1e-16)))
        return scores + gumbel.to(device=scores.device, dtype=scores.dtype)


def supports_continuous_batching(model) -> bool:
    """True when transformers' paged cache can serve ``model``: every layer type is one it knows."""
    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    types = getattr(config, "layer_types", None)
    return hasattr(model, "generate_batch") and (types is None or set(types) <= _PAGED_LAYER_TYPES)


def continuous_batching_refusal(model, regen: RegenConfig) -> str | None:
    """Why transformers' continuous batching cannot answer this run on ``model`` (its paged cache does
    not know a layer type; sampling, whose per-answer seeds it cannot honour), or None when it can."""
    if not supports_continuous_batching(model):
        types = sorted(set(getattr(getattr(model, "config", None), "layer_types", None) or []) - _PAGED_LAYER_TYPES)
        return (f"transformers' continuous batching cannot serve this target (layer types {', '.join(types)}: "
                "its paged cache knows full and sliding attention only)")
    if regen.temperature > 0:
        return "sampling with a seed per answer (continuous batching samples from one shared generator)"
    return None


def pick_engine(target, regen: RegenConfig, settings: Settings) -> tuple[str, str]:
    """``(engine, why)``: ``continuous_batching`` when it can serve this target and these options and
    is the faster of the two where the target runs, else ``generate``.

    On CUDA without a flash-attention package, continuous batching runs sdpa with no decode fast path
    (transformers says so) and answered at 0.37 of batched ``generate`` on the same prompts (Qwen3-8B
    shape, H200, 149 against 403 generated tok/s, BENCHMARKS.md "Regenerate on the H200"): ``generate``
    answers there. On the CPU, and on CUDA with flash attention, continuous batching answers.
    ``HSX_REGEN_ENGINE`` (environment): ``generate`` forces the batched ``generate``;
    ``continuous_batching`` forces continuous batching wherever it can serve the run."""
    forced = os.environ.get("HSX_REGEN_ENGINE", "").strip()
    if forced == GENERATE:
        return GENERATE, "HSX_REGEN_ENGINE=generate"
    refusal = continuous_batching_refusal(target.model, regen)
    if refusal:
        return GENERATE, refusal
    if forced == CONTINUOUS:
        return CONTINUOUS, "HSX_REGEN_ENGINE=continuous_batching"
    device = getattr(target, "device", None) or next(target.model.parameters()).device
    if torch.device(device).type == "cuda" and not flash_attention_installed():
        return GENERATE, ("no flash-attention package on CUDA: continuous batching would run sdpa without its decode "
                          "fast path, measured at 0.37 of the batched generate (HSX_REGEN_ENGINE=continuous_batching "
                          "forces it)")
    return CONTINUOUS, "greedy decoding of an attention-only target"


def generate_left_padded(model, prompts: list[list[int]], seeds: list[int], regen: RegenConfig,
                         eos_ids: list[int], pad_id: int) -> list[list[int]]:
    """Answer ``prompts`` (token ids) in one ``model.generate`` call, left-padded with an attention
    mask; returns each answer's generated ids, through its first end-of-turn / EOS id (the padding
    after it removed), at most ``regen.max_new_tokens``."""
    from transformers import GenerationConfig, LogitsProcessorList
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    device = next(model.parameters()).device
    B, L = len(prompts), max(len(p) for p in prompts)
    ids_BL = torch.full((B, L), int(pad_id), dtype=torch.long)
    mask_BL = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BL[i, L - len(p):] = torch.tensor(p, dtype=torch.long)
        mask_BL[i, L - len(p):] = 1
    processors = LogitsProcessorList()
    if regen.temperature > 0:  # transformers' own warpers, in the order its sampling applies them
        processors.append(TemperatureLogitsWarper(regen.temperature))
        if regen.top_k:
            processors.append(TopKLogitsWarper(regen.top_k))
        if regen.top_p < 1.0:
            processors.append(TopPLogitsWarper(regen.top_p))
        processors.append(SeededGumbel(seeds))
    config = GenerationConfig(max_new_tokens=regen.max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=list(eos_ids), pad_token_id=int(pad_id))
    out = model.generate(input_ids=ids_BL.to(device), attention_mask=mask_BL.to(device), generation_config=config,
                         logits_processor=processors)
    return [through_eos(row.tolist(), eos_ids) for row in out[:, L:].cpu()]


#: Attribute of a model whose continuous-batching manager transformers keeps between batches
#: (``generate_batch(persistent_manager=True)``): the key of the run sizing it was built for.
KEPT_MANAGER = "_hsx_kept_manager"


class _NoKeptManagerWarning(logging.Filter):
    """Drops transformers' warning, logged on every ``generate_batch(persistent_manager=True)``, that
    a kept manager "was sized specifically for the requests passed": ours is sized for the run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "persistent_manager=True" not in record.getMessage()


_quiet = _NoKeptManagerWarning()


def release_continuous_batching(model) -> None:
    """Drop the continuous-batching manager ``model`` keeps (its paged cache back to torch's
    allocator), if any. Call it under the GPU lock: before an extraction batch (whose forward limit
    was measured without that cache), on a failure, for another run's sizing."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()
    model.__dict__.pop(KEPT_MANAGER, None)


def release_kept_manager(model) -> None:
    """:func:`release_continuous_batching` when ``model`` keeps a regenerate run's manager, else
    nothing (a dict lookup: called before every extraction forward, ``workers/extract.py``)."""
    if KEPT_MANAGER in model.__dict__:
        release_continuous_batching(model)


#: Tokens per step of continuous batching (its ``max_batch_tokens``; a longer prompt is prefilled in
#: chunks of it). Not the batch's token budget: transformers sizes per-step buffers and, with sdpa, a
#: dense mask of step tokens x cache tokens from it; a regenerate batch's budget (65,536 tokens for the
#: Qwen3-8B run) asked for 419 GB on the H200 and every request failed (2026-12-03). vLLM's scheduler
#: takes a few thousand tokens per step the same way (``max_num_batched_tokens``).
CB_STEP_TOKENS = 4096


def flash_attention_installed() -> bool:
    """True when a flash-attention package (FA3's ``flash_attn_interface`` or ``flash_attn`` >= 2.3.3)
    is installed and CUDA is there: only then may continuous batching switch a bf16 target from sdpa
    to flash attention (``ContinuousBatchingConfig.auto_switch_to_flash``). Transformers' own default
    also switches when only the ``kernels`` package is there, fetching the kernel from the hub at the
    first batch, which a node without network cannot do: that fallback is not taken."""
    from transformers.utils import is_flash_attn_2_available, is_flash_attn_3_available

    return bool(is_flash_attn_3_available() or is_flash_attn_2_available())


def generate_continuous(model, prompts: list[list[int]], regen: RegenConfig, eos_ids: list[int],
                        pad_id: int, capacity: tuple[int, int, int] | None = None) -> list[list[int]]:
    """Answer ``prompts`` with transformers' continuous batching (``model.generate_batch``), greedy.

    ``capacity``: ``(batch_tokens, max_batch_samples, max_length)`` of the run, whose batches are cut
    so that rows x (longest prompt + max_new_tokens) fits ``batch_tokens`` (``producer/planner.py``
    ``RegenPlanJob``). The manager and its paged cache are then sized for any batch of the run (every
    choice that may change an answer explicit: the cache's pages, tokens per step, rows per step, pages
    per request, no prefix sharing) and kept on the model for the next batch (transformers'
    ``persistent_manager``), so that a worker builds one per run, not one per batch; an answer depends
    on its batch only, never on what the worker answered before (its manager is reset between
    batches, and without prefix sharing no page of an earlier batch is read). Another sizing or other
    end ids (another run) build a new one; a failure, and an extraction batch
    (``workers/extract.py``), drop it (:func:`release_continuous_batching`). None: a manager sized
    for these prompts alone, dropped after them.

    Raises RuntimeError when it did not return a finished answer for every prompt (``generate_batch``
    logs and swallows its own errors, and returns a failed request as an output with status FAILED,
    its error and no tokens): the caller then answers with :func:`generate_left_padded`."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.requests import RequestStatus

    config = GenerationConfig(max_new_tokens=regen.max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                              pad_token_id=int(pad_id))
    page = ContinuousBatchingConfig().page_size
    switch = flash_attention_installed()
    key = None
    if capacity is None:
        # The paged cache sized for this batch's prompts and answers (pages of page_size tokens, one spare
        # each): left to itself it sizes itself from the free memory, minutes of allocation on a CPU host.
        pages = sum(-(-(len(p) + regen.max_new_tokens) // page) + 1 for p in prompts)
        step = max(min(sum(len(p) for p in prompts), CB_STEP_TOKENS), page)
        sizing = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=step,
                                          auto_switch_to_flash=switch)
    else:
        batch_tokens, rows, max_length = (int(v) for v in capacity)
        # a request's pages: ceil((prompt + answer) / page) + 1 <= (prompt + answer) / page + 2, and a
        # batch's (prompt + answer) sum to at most batch_tokens; per request, at most max_length + answer
        per_request = -(-(max_length + regen.max_new_tokens) // page) + 1
        sizing = ContinuousBatchingConfig(num_blocks=-(-batch_tokens // page) + 2 * rows,
                                          max_batch_tokens=max(min(batch_tokens, CB_STEP_TOKENS), page),
                                          max_requests_per_batch=rows,
                                          max_blocks_per_request=per_request + per_request % 2, allow_block_sharing=False,
                                          auto_switch_to_flash=switch)
        key = (tuple(int(i) for i in eos_ids), int(pad_id), batch_tokens, rows, max_length, int(regen.max_new_tokens))
        if model.__dict__.get(KEPT_MANAGER, key) != key:
            release_continuous_batching(model)  # another run's manager: its sizing and end ids are not these
        logging.getLogger("ContinuousBatchingLogger").addFilter(_quiet)  # once: a set of filters
    try:
        results = model.generate_batch(inputs=[list(p) for p in prompts], generation_config=config,
                                       continuous_batching_config=sizing, progress_bar=False, warmup=False,
                                       persistent_manager=key is not None)
        outs = list(results.values())
        if len(outs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outs)} answers for {len(prompts)} prompts")
        # A request the engine failed comes back with status FAILED, its error as text and no tokens
        # (transformers' continuous_api ``fail_and_deliver``): never an answer.
        failed = [o for o in outs if o.error is not None or o.status != RequestStatus.FINISHED]
        if failed:
            raise RuntimeError(f"generate_batch failed {len(failed)} of {len(prompts)} requests "
                               f"(status {getattr(failed[0].status, 'name', failed[0].status)}): {failed[0].error}")
    except BaseException:
        if key is not None:  # a manager in whatever state the failure left: never reused
            release_continuous_batching(model)
        raise
    if key is not None:
        model.__dict__[KEPT_MANAGER] = key
    return [through_eos(list(o.generated_tokens), eos_ids)[:regen.max_new_tokens] for o in outs]


def through_eos(ids: list[int], eos_ids) -> list[int]:
    """``ids`` up to and including the first end id (all of them when none is there)."""
    stops = set(int(i) for i in eos_ids)
    for k, t in enumerate(ids):
        if t in stops:
            return ids[:k + 1]
    return ids


def chat_for(config, settings: Settings):
    """The run's :class:`producer.masks.ChatTokeniser`, built once per run and process, as the planner
    built it (same template, ``enable_thinking``, content modes). Raises BadPlan when the template
    the worker gets is not the one planned (its sha256 in run.json)."""
    from producer.tokenising import TokeniserSpec

    key = config.run_id + config.identity_sha256()
    with _chats_lock:
        if key in _chats:
            return _chats[key]
        regen = RegenConfig.of(config)
        spec = TokeniserSpec(model=settings.model or config.model_name, cache_dir=str(settings.cache_dir),
                             trust_remote_code=settings.trust_remote_code, max_length=config.max_length,
                             enable_thinking=config.tokenizer.enable_thinking,
                             over_length=config.sample_policy.over_length or "truncate",
                             special_tokens_in_content=config.special_tokens_in_content, allow_text=False,
                             chat_template=regen.chat_template, added_tokens_in_content=config.added_tokens_in_content)
        chat = spec.build()[1]
        if chat.template_sha256 != config.tokenizer.chat_template_sha256:
            raise BadPlan(f"run {config.run_id}: this worker's chat template (sha256 {chat.template_sha256[:12]}) is not "
                          f"the one the run was planned with ({config.tokenizer.chat_template_sha256[:12]}): the "
                          "tokenizer files differ between the planner and this worker; give both the same checkpoint")
        _chats[key] = chat
        return chat


def prompt_ids(chat, record_id: str, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt, tokenised as the planner
    tokenises a render (``ChatTokeniser``'s escaping of content's special-token strings: its
    ``_prepare`` / ``_render`` / ``_tokenise``, the same package's code). Raises BadRecord
    ``template_error`` when the template fails."""
    from producer.datasets import Conversation

    prepared = chat._prepare(Conversation(record_id, tuple(messages), tuple(tools) if tools else None))
    text = chat._render(record_id, prepared.messages, prepared.tools, add_generation_prompt=True)
    ids, _ = chat._tokenise(text, with_offsets=False, esc=prepared.esc)
    return [int(i) for i in ids]


def answer_message(original: dict, text: str) -> dict:
    """The assistant message of an answer: ``original`` (role, name...) with ``content`` the answer's
    text; a ``<think>...</think>`` block at its start becomes ``reasoning_content`` (the Qwen3
    templates' field). The original's ``tool_calls`` and ``reasoning_content`` are dropped: they
    belonged to the replaced answer."""
    out = {k: v for k, v in original.items() if k not in ("content", "tool_calls", "reasoning_content")}
    if "</think>" in text:
        reasoning, content = text.split("</think>", 1)
        reasoning = reasoning.replace("<think>", "", 1).strip()
        if reasoning:
            out["reasoning_content"] = reasoning
        text = content.lstrip("\n")
    out["content"] = text
    return out


def finish(tokenizer, ids: list[int], eos_ids, regen: RegenConfig) -> tuple[str, str, int]:
    """``(text, finish reason, completion tokens)`` of generated ``ids``: the text without its final
    end-of-turn token, cut before the first ``--stop`` string (then the completion tokens are those of
    the kept text).

    Raises RuntimeError for ``ids`` that neither end with an end-of-turn id nor reach
    ``max_new_tokens``: no engine stops there on its own (an empty list from a failed request was once
    recorded as a finished answer)."""
    stopped = bool(ids) and int(ids[-1]) in set(int(i) for i in eos_ids)
    body = ids[:-1] if stopped else ids
    text = tokenizer.decode(body, skip_special_tokens=False)
    cuts = [text.find(s) for s in regen.stop if s in text]
    if cuts:
        text = text[:min(cuts)]
        return text, "stop_string", len(tokenizer.encode(text, add_special_tokens=False))
    if stopped:
        return text, "stop", len(ids)
    if len(ids) < regen.max_new_tokens:  # neither an end id nor the limit: the engine lost the answer's end
        raise RuntimeError(f"an answer of {len(ids)} tokens ends without an end-of-turn id before "
                           f"--max-new-tokens {regen.max_new_tokens}: the engine's output is cut, not an answer")
    return text, "length", len(ids)


def answer_batch(target, chat, convs: list[PlannedConversation], regen: RegenConfig, max_length: int,
                 settings: Settings, batch: str,
                 capacity: tuple[int, int, int] | None = None) -> tuple[list[RegeneratedConversation], str, dict]:
    """Regenerate the assistant turns of ``convs`` (see the module docstring); returns the shard's
    conversations, the engine that answered and ``{"rounds", "generate_s"}``. ``capacity``: the run's
    ``(batch_tokens, max_batch_samples, max_length)``, the continuous-batching manager then kept for
    the run's next batches (:func:`generate_continuous`)."""
    tokenizer = chat.tokenizer
    eos_ids = sorted(int(i) for i in chat.end_of_turn_ids)
    engine, why = pick_engine(target, regen, settings)
    if (engine, why) not in _said_engine:
        _said_engine.add((engine, why))
        log.info("regenerate: engine %s (%s)", engine, why)
    states = []
    for c in convs:
        assistant = [i for i, m in enumerate(c.messages) if m.get("role") == "assistant"]
        state = {"conv": c, "messages": [dict(m) for m in c.messages], "turns": assistant, "answers": [],
                 "stopped": False, "prompt": None}
        if regen.turns == "last":
            # The last assistant turn whose prompt fits in max_length (the planner truncated the
            # conversation there too); the turns after it are dropped. None fits: the first, marked
            # prompt_too_long below.
            state["turns"] = assistant[:1]
            for t in reversed(assistant):
                ids = prompt_ids(chat, c.record_id, c.messages[:t], c.tools)
                if len(ids) < max_length:
                    state["turns"], state["prompt"] = [t], ids
                    break
        states.append(state)
    rounds = max((len(s["turns"]) for s in states), default=0)
    generate_s = 0.0
    for k in range(rounds):
        todo, prompts, seeds = [], [], []
        for s in states:
            if s["stopped"] or k >= len(s["turns"]):
                continue
            t = s["turns"][k]
            ids = s["prompt"] if k == 0 and s["prompt"] is not None else \
                prompt_ids(chat, s["conv"].record_id, s["messages"][:t], s["conv"].tools)
            if len(ids) >= max_length:  # the prompt alone fills the run's max_length: later turns' would too
                s["answers"].append(Answer(turn=t, finish_reason="prompt_too_long", prompt_tokens=len(ids),
                                           completion_tokens=0))
                s["stopped"] = True
                continue
            todo.append((s, t, len(ids)))
            prompts.append(ids)
            seeds.append(sample_seed(regen.seed, s["conv"].record_id, t))
        if not todo:
            continue
        with target.gpu_lock:
            t0 = time.perf_counter()  # after the lock: generate_s is the engine's time, not another task's
            outs = None
            if engine == CONTINUOUS:
                try:
                    outs = generate_continuous(target.model, prompts, regen, eos_ids, target.pad_token_id, capacity)
                except Exception as exc:  # the engine failed on this target: the batched generate answers
                    engine = GENERATE
                    log.warning("batch %s: continuous batching failed (%s: %s); answering with the batched generate "
                                "(left padding) instead", batch, exc.__class__.__name__, exc)
            if outs is None:
                outs = generate_left_padded(target.model, prompts, seeds, regen, eos_ids, target.pad_token_id)
        generate_s += time.perf_counter() - t0
        for (s, t, n_prompt), ids in zip(todo, outs):
            text, reason, n = finish(tokenizer, ids, eos_ids, regen)
            s["messages"][t] = answer_message(s["messages"][t], text)
            s["answers"].append(Answer(turn=t, finish_reason=reason, prompt_tokens=n_prompt, completion_tokens=n))
            if reason not in FINISHED:
                s["stopped"] = True  # a cut answer is not fed to the next turn's prompt
    out = []
    for s in states:
        last = s["answers"][-1].turn if s["answers"] else len(s["messages"]) - 1
        answered = [a for a in s["answers"] if a.finish_reason != "prompt_too_long"]
        if answered:
            last = answered[-1].turn  # the messages through the last answer (a turn left unanswered is dropped)
        out.append(RegeneratedConversation(
            id=s["conv"].record_id, sample_index=s["conv"].sample_index, messages=s["messages"][:last + 1],
            tools=s["conv"].tools, regenerated=s["answers"],
            finished=bool(answered) and all(a.finish_reason in FINISHED for a in answered)))
    return out, engine, {"rounds": rounds, "generate_s": round(generate_s, 4)}


def regenerate_batch(admitted, settings: Settings, job) -> dict:
    """The body of a regenerate run's task (``workers.extract.extract_batch`` admitted it): answer the
    batch, store its shard, write its marker last. Same result and errors as the extraction body:
    ``{"status": "done" | "lost_race", ...}``; BadPlan for a damaged plan, ModelNotServed for another
    checkpoint, RunCancelled (``cancel --now``), StoreError."""
    from workers.room import _check_cancelled_now, _retry, until_room
    from workers.target import get_target

    t0 = time.perf_counter()
    run_url, batch, store, config, plan = admitted.run_url, admitted.batch, admitted.store, admitted.config, admitted.plan
    regen = RegenConfig.of(config)
    job.phase("loading")
    target = get_target(settings.model or config.model_name, settings)
    job.heartbeat.device = target.engine.get("device")
    if target.group is not None:  # generate on rank 0 alone would wait forever in the followers' collectives
        raise ModelNotServed(f"batch {batch} of regenerate run {config.run_id}: this worker leads a tensor-parallel group "
                             f"of {target.group.size} ranks, and a group does not answer regenerate batches (not built); "
                             "fix: run the regenerate stage on workers with --gpus-per-worker 1 (HSX_GPUS_PER_WORKER=1)")
    differences = target.info.differences(config.model)
    if differences:
        raise ModelNotServed(f"batch {batch}: this worker's checkpoint is not the one run {config.run_id} was planned "
                             f"for ({'; '.join(differences)}); re-plan the run or point the worker at the same checkpoint")
    key = regen_plan_key(batch)
    convs = parse_lines(_retry(settings, f"read {key}", lambda: store.read(key)), PlannedConversation,
                        f"{key} of run {config.run_id}")
    planned = [int(i) for i in plan.sample_index_N]
    if [c.sample_index for c in convs] != planned:
        raise BadPlan(f"{key} of run {config.run_id}: its samples {[c.sample_index for c in convs][:6]}... are not the "
                      f"batch's {planned[:6]}...; the plan was damaged after planning: plan the run again into a new output")
    chat = chat_for(config, settings)
    _check_cancelled_now(job)
    job.phase("forward")
    answered, engine, timing = answer_batch(target, chat, convs, regen, config.max_length, settings, batch,
                                            (config.batch_tokens, config.max_batch_samples, config.max_length))
    hooks = faults.hooks()  # the tests' pauses, at the points the extraction body has them (workers/faults.py)
    hooks.pause("forward", batch)
    _check_cancelled_now(job)
    data = b"".join(c.to_line() for c in answered)
    attempt = uuid.uuid4().hex[:12]
    shard = regen_shard_key(batch, attempt)
    job.phase("writing")
    nbytes, sha256 = until_room(job, f"store shard {shard}",
                                lambda: _retry(settings, f"store shard {shard}",
                                               lambda: store.write_stream(shard, [memoryview(data)])), len(data))
    hooks.pause("marker", batch)
    prompt_tokens = sum(a.prompt_tokens for c in answered for a in c.regenerated)
    completion = sum(a.completion_tokens for c in answered for a in c.regenerated)
    marker = RegenMarker(
        run_id=config.run_id, batch=batch, config_sha256=config.identity_sha256(),
        shard=ShardRef(key=shard, bytes=nbytes, sha256=sha256), num_samples=len(answered),
        num_tokens=prompt_tokens + completion, supervised_tokens=completion,
        planned_samples=plan.num_samples, planned_tokens=plan.num_tokens, quarantined=[], num_quarantined=0,
        worker=MarkerWorker(host=socket.gethostname(), pid=os.getpid(), device=target.engine["device"]),
        model_revision=target.info.revision, forward_s=timing["generate_s"], forwards=timing["rounds"],
        seconds=round(time.perf_counter() - t0, 4), engine=engine,
        unfinished=sum(1 for c in answered if not c.finished),
        stop_cut=sum(1 for c in answered if any(a.finish_reason == "stop_string" for a in c.regenerated)),
        finished_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), finished_unix=round(time.time(), 3))

    def certify() -> bool:
        # as workers/extract.py: a lost race is a settled one only
        if marker.create(store):
            return True
        existing = RegenMarker.read(store, batch)
        if existing is None:
            raise StoreError(f"marker of batch {batch}: the conditional create found one, a read finds none; not settled",
                             transient=True)
        return existing.shard.key == shard

    try:
        _check_cancelled_now(job)
    except RunCancelled:
        _retry(settings, f"delete shard {shard}", lambda: store.delete(shard))
        raise
    job.phase("marker")
    if not until_room(job, f"write the marker of batch {batch}",
                      lambda: _retry(settings, f"write the marker of batch {batch}", certify), 1 << 20):
        _retry(settings, f"delete shard {shard}", lambda: store.delete(shard))
        log.info("batch %s: another worker wrote the marker first; removed our shard %s", batch, shard)
        return {"status": "lost_race", "batch": batch}
    log.info("batch done %s", json.dumps({"run": config.run_id, "batch": batch, "kind": "regenerate", "engine": engine,
                                          "samples": len(answered), "completion_tokens": completion,
                                          "unfinished": marker.unfinished, "stop_cut": marker.stop_cut,
                                          "seconds": marker.seconds,
                                          "tok_s": round(completion / max(timing["generate_s"], 1e-9))}))
    return {"status": "done", "batch": batch, "num_tokens": marker.num_tokens, "num_quarantined": 0,
            "seconds": marker.seconds}
