"""Train a small EAGLE-3-style draft head from a run that is still being extracted.

Legend: S = tokens of one sample, T = S - 2 predicted positions, H = the target's hidden size,
V = its vocabulary, D = the draft vocabulary (``--draft-vocab``).

    # terminal 1: extract (prints the run's address: "follow it from another terminal: ... <run>")
    python -m producer run sharegpt --limit 200 --model tiny-qwen3.5 --output ./out
    # terminal 2: train on each batch as soon as its marker exists; Ctrl-C and run again to resume
    python examples/train_while_extracting.py ./out/<run_id> --checkpoint head.pt

The run must have been extracted with ``--preset eagle3`` (the default; K = 3 layers: low, mid,
high). The head follows the shape of EAGLE-3 (Li et al., "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test", 2025) and SpecForge's Llama draft
(``specforge/modeling/draft/llama3_eagle.py``): the three captured layers [S, 3H] are fused by one
linear layer to [S, H]; at position t that feature is joined with the embedding of token t+1 and
one causal decoder layer predicts token t+2 over a draft vocabulary of V' tokens, through the rows
of the target's own ``lm_head`` for those tokens (frozen); the embedding is the target's, frozen too.
The draft vocabulary is, as in SpecForge's ``generate_vocab_mapping_file``, the ``--draft-vocab`` most
frequent supervised tokens of the dataset, here counted in the run's plan (``plan/batches/``). The
plan is streamed, one window of the dataset at a time (hsx/plan.py), so the count is over the
samples planned once at least ``--vocab-samples`` are (default 1024: the first window, planned
seconds after the start), or over the whole plan when it is smaller or complete; ``--vocab-samples
0`` waits for the whole plan (SpecForge's count, but no training before the planning ends).
Positions whose target is outside it are left out of the loss. The reader follows the plan's
windows as they appear, and the run's batches as they are certified. The loss is cross-entropy on the supervised tokens (``loss_mask``). Not reproduced
here: SpecForge's training-time-test unroll and its soft targets from the target's logits. With
``tiny-qwen3.5`` the states are those of a random-weight model: the loss shows that training runs,
not that the head is useful.

Every ``--save-every`` steps (and at the end) it writes ``--checkpoint`` (head, optimizer, step and
the reader's position, one ``torch.save`` file replaced atomically); started again with the same
checkpoint, it continues after the last sample it trained on, whatever the run did meanwhile.
Ctrl-C (SIGINT) saves it too, at the last step done (a step under way finishes first; samples read
after it are read again on resume), says what it saved and exits 130.
``--log-jsonl`` writes one JSON line per step (``step``, ``loss``, ``batches``, ``samples``
trained on, ``certified`` / ``planned`` batches of the run at that moment, ``plan_complete``: whether
``planned`` is all of them) and a last line with ``done`` (``interrupted`` after a Ctrl-C).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

from hsx.live import LiveHiddenStatesDataset  # noqa: E402
from hsx.models import resolve_model_path  # noqa: E402
from hsx.plan import planned_batches, planning_failed, read_batch, read_planning_record  # noqa: E402
from settings import Settings  # noqa: E402


def target_embeddings(model_name: str, cache_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(embed_VH, lm_head_VH)`` float32 of the run's target, read from its safetensors files only.

    Raises:
        SystemExit: the model is a hub id (give a local checkpoint with ``--target-dir``), or its
            files hold no ``*embed_tokens.weight``.
    """
    from safetensors import safe_open

    path = Path(resolve_model_path(model_name, cache_dir))
    if not path.is_dir():
        raise SystemExit(f"the run's target {model_name!r} is a hub id: download it (huggingface-cli download "
                         f"{model_name}) and pass its directory with --target-dir")
    embed = lm_head = None
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                if key.endswith("embed_tokens.weight") and "visual" not in key:
                    embed = f.get_tensor(key).float()
                elif key == "lm_head.weight":
                    lm_head = f.get_tensor(key).float()
    if embed is None:
        raise SystemExit(f"{path}: no *embed_tokens.weight in its *.safetensors files")
    return embed, embed if lm_head is None else lm_head  # tied embeddings: lm_head is the embedding


def draft_vocabulary(run_store, size: int, *, min_samples: int, wait_s: float, poll_s: float) -> tuple[torch.Tensor, int]:
    """``(d2t_D int64 ascending, samples counted)``: the target ids of the ``size`` most frequent
    supervised tokens of the run's plan (ties by id), counted over the batches planned once at
    least ``min_samples`` samples are (0: once the plan is complete), or all of a complete plan.
    SpecForge stores the same set as offsets (``d2t[i] = id - i``).

    SpecForge (``specforge/data/preprocessing.py``, ``generate_vocab_mapping_file``) counts the
    loss-masked tokens of the whole training set the same way; a streamed plan's first windows are
    the dataset's first records, in its order.

    Raises:
        SystemExit: not enough samples are planned after ``wait_s`` seconds, or the planning failed first.
    """
    deadline = time.monotonic() + wait_s
    while True:
        batches, complete = planned_batches(run_store)
        samples = sum(b.num_samples for b in batches)
        if complete or (min_samples and samples >= min_samples):
            break
        why = planning_failed(read_planning_record(run_store))
        if why and not batches:
            raise SystemExit(f"{run_store.url}: its planning failed ({why}) before any batch was planned; "
                             "fix the cause and run the producer again")
        if why:  # the windows it wrote are all there will be until the producer runs again
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"{run_store.url}: {samples} samples planned after {wait_s:.0f} s, fewer than --vocab-samples "
                             f"{min_samples}; `python -m producer status {run_store.url}` says why")
        time.sleep(poll_s)
    counts = collections.Counter()
    for b in batches:
        plan = read_batch(run_store, b.batch)
        counts.update(plan.input_ids_T[plan.loss_mask_T.astype(bool)].tolist())
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:size]
    return torch.tensor(sorted(t for t, _ in top), dtype=torch.int64), samples


class Eagle3Head(nn.Module):
    """EAGLE-3-shaped draft head over the target's captured low / mid / high layers.

    ``forward(hidden_S3H, input_ids_S)`` returns logits float32 [T, D] (T = S - 2): row t scores
    the draft vocabulary ``d2t_D`` for token t+2, from the fused feature of token t and the
    embedding of token t+1.
    """

    def __init__(self, embed_VH: torch.Tensor, lm_head_VH: torch.Tensor, d2t_D: torch.Tensor,
                 num_layers_captured: int = 3, heads: int = 4):
        super().__init__()
        H = embed_VH.shape[1]
        self.embed = nn.Embedding.from_pretrained(embed_VH, freeze=True)
        self.register_buffer("d2t_D", d2t_D)
        self.lm_head = nn.Linear(H, d2t_D.shape[0], bias=False)  # the target's lm_head rows of the draft vocabulary
        self.lm_head.weight = nn.Parameter(lm_head_VH[d2t_D].clone(), requires_grad=False)
        self.fc = nn.Linear(num_layers_captured * H, H, bias=False)  # EAGLE-3: fuse low, mid, high
        self.join = nn.Linear(2 * H, H, bias=False)  # [embedding; feature] -> H
        self.layer = nn.TransformerEncoderLayer(H, heads, dim_feedforward=2 * H, batch_first=True, norm_first=True)
        self.norm = nn.LayerNorm(H)

    def forward(self, hidden_S3H: torch.Tensor, input_ids_S: torch.Tensor) -> torch.Tensor:
        feature_TH = self.fc(hidden_S3H[:-2].float())
        x_1TH = self.join(torch.cat([self.embed(input_ids_S[1:-1]), feature_TH], dim=-1))[None]
        T = x_1TH.shape[1]
        causal_TT = torch.triu(torch.full((T, T), float("-inf")), diagonal=1)
        return self.lm_head(self.norm(self.layer(x_1TH, src_mask=causal_TT, is_causal=True)[0]))


def sample_loss(head: Eagle3Head, sample: dict) -> tuple[torch.Tensor, int]:
    """(sum of cross-entropy over the supervised targets inside the draft vocabulary, their count)."""
    ids_S, mask_S = sample["input_ids"], sample["loss_mask"]
    if ids_S.shape[0] < 3:
        return torch.zeros(()), 0
    target_T = ids_S[2:]
    slot_T = torch.searchsorted(head.d2t_D, target_T).clamp(max=head.d2t_D.shape[0] - 1)  # d2t_D is sorted
    keep_T = mask_S[2:].bool() & (head.d2t_D[slot_T] == target_T)
    if not keep_T.any():
        return torch.zeros(()), 0
    logits_TD = head(sample["hidden_states"], ids_S)
    return nn.functional.cross_entropy(logits_TD[keep_T], slot_T[keep_T], reduction="sum"), int(keep_T.sum())


def save(path: Path, head: Eagle3Head, optimizer, step: int, reader_state: dict) -> None:
    trainable = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed.", "lm_head."))}  # + d2t_D
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"head": trainable, "optimizer": optimizer.state_dict(), "step": step, "reader": reader_state}, tmp)
    os.replace(tmp, path)  # a crash mid-save leaves the previous checkpoint whole


class _StepGuard:
    """SIGINT as KeyboardInterrupt, except inside a training step: there it is held until the step
    (and its checkpoint) is done, so that an interrupt never leaves a half-applied optimizer step."""

    def __init__(self):
        self.in_step = False
        self.pending = False

    def on_sigint(self, signum, frame) -> None:
        if self.in_step:
            self.pending = True
        else:
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        self.in_step = True

    def __exit__(self, *exc) -> None:
        self.in_step = False
        if self.pending and exc[0] is None:
            self.pending = False
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="the run's address: <output>/<run_id> or s3://bucket/prefix/<run_id>")
    ap.add_argument("--checkpoint", type=Path, help="resume from / save to this file")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps (total, resumed ones included)")
    ap.add_argument("--samples-per-step", type=int, default=4)
    ap.add_argument("--save-every", type=int, default=5, help="steps between checkpoints")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--draft-vocab", type=int, default=4096, help="draft vocabulary size D (SpecForge: 32000)")
    ap.add_argument("--vocab-samples", type=int, default=1024,
                    help="count the draft vocabulary once this many samples are planned (0: over the whole plan, "
                         "waiting for the planning to end)")
    ap.add_argument("--seed", type=int, default=0, help="batch order and head initialisation")
    ap.add_argument("--poll-s", type=float, default=2.0, help="seconds between looks for new markers")
    ap.add_argument("--idle-timeout-s", type=float, default=600.0, help="stop after this long without a new batch")
    ap.add_argument("--wait-for-run-s", type=float, default=600.0, help="wait this long for run.json to appear")
    ap.add_argument("--target-dir", help="local checkpoint of the run's target (default: the run's model)")
    ap.add_argument("--log-jsonl", type=Path, help="append one JSON line per step here")
    args = ap.parse_args(argv)

    settings = Settings()
    torch.manual_seed(args.seed)
    reader = LiveHiddenStatesDataset(args.run, seed=args.seed, finals="none", settings=settings, poll_s=args.poll_s,
                                     idle_timeout_s=args.idle_timeout_s, wait_for_run_s=args.wait_for_run_s)
    if len(reader.layer_ids) != 3:
        raise SystemExit(f"run {reader.config.run_id} captured layers {reader.layer_ids}: an EAGLE-3 head needs the 3 "
                         "layers of --preset eagle3")
    embed_VH, lm_head_VH = target_embeddings(args.target_dir or reader.config.model_name, settings.cache_dir)
    state = None
    if args.checkpoint and args.checkpoint.exists():
        state = torch.load(args.checkpoint, weights_only=True)  # tensors and plain containers only: no pickle code
        d2t_D = state["head"]["d2t_D"]
    else:
        d2t_D, counted = draft_vocabulary(reader.store, args.draft_vocab, min_samples=args.vocab_samples,
                                          wait_s=args.wait_for_run_s, poll_s=args.poll_s)
        print(f"draft vocabulary: the {d2t_D.shape[0]:,} most frequent supervised tokens of {counted:,} planned samples")
    head = Eagle3Head(embed_VH, lm_head_VH, d2t_D)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=args.lr)
    step = 0
    if state is not None:
        result = head.load_state_dict(state["head"], strict=False)  # the frozen target weights are not saved
        if result.unexpected_keys or set(result.missing_keys) - {"embed.weight", "lm_head.weight"}:
            raise SystemExit(f"{args.checkpoint} is not a checkpoint of this head: {result}")
        optimizer.load_state_dict(state["optimizer"])
        reader.load_state_dict(state["reader"])
        step = int(state["step"])
        print(f"resumed at step {step}: {reader.progress()['yielded']} batches of {reader.config.run_id} read")
    log = open(args.log_jsonl, "a") if args.log_jsonl else None
    # The reader's position after the last sample trained on: what a checkpoint at a Ctrl-C holds
    # (the reader itself is past the samples gathered for the next step, not trained on yet).
    trained_state = reader.state_dict()
    guard = _StepGuard()

    def finish_step(group: list[dict]) -> None:
        with guard:  # a Ctrl-C during the step waits for its end: head, optimizer and position agree
            _finish_step(group)

    def _finish_step(group: list[dict]) -> None:
        nonlocal step, trained_state
        t0 = time.perf_counter()
        optimizer.zero_grad()
        total, count = torch.zeros(()), 0
        for sample in group:
            loss, n = sample_loss(head, sample)
            total, count = total + loss, count + n
        if count:
            (total / count).backward()
            optimizer.step()
        step += 1
        trained_state = reader.state_dict()
        progress = reader.progress()
        line = {"step": step, "loss": round(float(total.detach()) / max(count, 1), 4), "tokens": count,
                "batches": sorted({s["batch"] for s in group}), "samples": [s["sample_index"] for s in group],
                "certified": progress["certified"], "planned": progress["planned"],
                "plan_complete": reader.plan_complete, "seconds": round(time.perf_counter() - t0, 3)}
        so_far = "" if reader.plan_complete else " planned so far"
        print(f"step {step:4d}  loss {line['loss']:.3f}  {count:5d} tokens  from {','.join(line['batches'])}  "
              f"run: {progress['certified']}/{progress['planned'] or '?'} batches{so_far} certified")
        if log:
            log.write(json.dumps(line) + "\n")
            log.flush()
        if args.checkpoint and step % args.save_every == 0:
            save(args.checkpoint, head, optimizer, step, trained_state)

    group: list[dict] = []
    previous = signal.signal(signal.SIGINT, guard.on_sigint)
    try:
        for sample in reader:
            group.append(sample)
            if len(group) == args.samples_per_step:
                finish_step(group)
                group = []
                if args.max_steps is not None and step >= args.max_steps:
                    break
        else:
            if group:  # the run is over (or idle): train on what is left
                finish_step(group)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the save short
        where = f"saved {args.checkpoint}" if args.checkpoint else "nothing saved (no --checkpoint)"
        if args.checkpoint:
            save(args.checkpoint, head, optimizer, step, trained_state)
        print(f"interrupted at step {step}: {where}" + (
            f" (step {step}, {trained_state['cursor']} batches of {reader.config.run_id} read whole; "
            f"{len(group)} samples read after the last step are read again on resume: run the same command)"
            if args.checkpoint else ""), flush=True)
        if log:
            log.write(json.dumps({"done": True, "interrupted": True, "steps": step, **reader.progress()}) + "\n")
            log.close()
        return 130
    finally:
        signal.signal(signal.SIGINT, previous)
    if args.checkpoint:
        save(args.checkpoint, head, optimizer, step, trained_state)
    done = {"done": True, "steps": step, "stop_reason": reader.stop_reason, **reader.progress()}
    print(f"stopped after {step} steps ({reader.stop_reason or 'max steps'}); "
          f"{done['yielded']}/{done['planned'] or '?'} batches read")
    if log:
        log.write(json.dumps(done) + "\n")
        log.close()
    return 0


if __name__ == "__main__":
    from hsx.errors import HsxError
    from hsx.store import MissingKey

    try:
        raise SystemExit(main())
    except (HsxError, MissingKey) as exc:  # a bad run, checkpoint or setting: its message says what and the fix, no traceback
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # before the first step (loading, waiting for the run): nothing trained yet
        print("interrupted before training began: nothing to save", file=sys.stderr)
        raise SystemExit(130) from None
