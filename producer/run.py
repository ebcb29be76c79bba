"""``python -m producer run``: the whole job on one machine.

Check the request -> (embedded broker if no broker URL is set) -> local workers (they load the
model meanwhile) -> plan, each window's batches enqueued as it is written -> wait with a progress
bar -> stop what we started -> summary. A second run of the same job finds every marker and starts
nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hsx.broker import EmbeddedBroker, check_broker
from hsx.errors import RunCancelled, StoreError
from hsx.records import BatchSummary, Cancelled, done_batches, read_failures, read_markers
from hsx.regen import RegenMarker, is_regenerate
from hsx.store import mask_url
from hsx.layout import window_key
from hsx.plan import plan_complete
from hsx.store import exists
from producer import interrupts
from producer.enqueue import WindowSender
from producer.reconcile import RunReconciler
from producer.planner import PlanJob, PlanOptions, PlannedRun, check_extraction_layers, prepare_plan
from producer.status import recent_rate, workers_log_path
from producer.words import noun, plural
from settings import Settings

log = logging.getLogger(__name__)


def settings_env(settings: Settings, **overrides) -> dict[str, str]:
    """The environment for child processes: ours plus every set setting as ``HSX_*``."""
    env = dict(os.environ)
    values = settings.model_dump()
    values.update(overrides)
    for name, value in values.items():
        if value is None:
            continue
        env[f"HSX_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env


def worker_env(settings: Settings, broker_url: str, model: str, batch_tokens: int) -> dict[str, str]:
    """The environment of the workers ``producer run`` starts: :func:`settings_env` with the
    embedded broker, the run's model, and the run's ``batch_tokens`` as ``HSX_BATCH_TOKENS``, so
    that their warm-up compiles the kernels a batch of that budget meets (``workers/target.py``:
    fla's row buckets) before the first batch, not during the run."""
    return settings_env(settings, broker_url=broker_url, model=model, batch_tokens=batch_tokens)


#: Seconds ``run`` waits for its workers to finish the batches they hold when it stops; then it kills them.
WORKERS_STOP_TIMEOUT_S = 60.0


class LocalWorkers:
    """``python -m workers`` as a child process, logging to a file; stopped with SIGTERM (warm shutdown)."""

    def __init__(self, env: dict[str, str], log_path: Path, count: int | None = None):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        # One JSON line per worker death or worker ready, said as it happens (producer/worker_events.py); a new file per start.
        self.events_path = log_path.with_suffix(".events.jsonl")
        self.events_path.unlink(missing_ok=True)
        # --exit-with-parent: if this process dies without stopping them (SIGKILL, a crash), the
        # workers shut down instead of serving the next run's broker with this run's environment.
        cmd = [sys.executable, "-m", "workers", "--exit-with-parent", str(os.getpid()), "--events", str(self.events_path)] + (
            ["--count", str(count)] if count else [])
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_description(self) -> str | None:
        """How ``python -m workers`` ended (``killed by SIGKILL``, ``exited with code 1``), None while it runs."""
        from hsx.processes import describe_exit

        code = self.proc.poll()
        return None if code is None else describe_exit(code)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout_s: float | None = None, say=None, every_s: float = 10.0, on_kill=None) -> None:
        """Warm shutdown: SIGTERM, wait up to ``timeout_s`` for the workers to finish the batches they
        hold, then SIGKILL (``on_kill()`` first, to say so). ``say(waited_s)`` is called every
        ``every_s`` seconds of the wait (the user sees the stop drain, not a frozen bar)."""
        timeout_s = WORKERS_STOP_TIMEOUT_S if timeout_s is None else timeout_s
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            while True:
                left = timeout_s - (time.monotonic() - start)
                try:
                    self.proc.wait(max(0.0, min(every_s, left)))
                    break
                except subprocess.TimeoutExpired:
                    if left <= every_s:
                        if on_kill is not None:
                            on_kill()
                        self.kill()
                        return
                    if say is not None:
                        say(time.monotonic() - start)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the workers' process group (no warm shutdown) and wait for it."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def _failed(run_store, done: set[str]) -> dict[str, dict]:
    """The failure records (:class:`hsx.records.Failure`) of the batches not in ``done``, as the report's JSON."""
    return {batch: f.model_dump(exclude={"schema_version"}) for batch, f in read_failures(run_store, done).items()}


class PauseWatch:
    """Tells ``producer run``'s user when the workers that serve the run pause for a full store.

    Reads the live workers' presences on the broker (``hsx/fleet.py``) at most every
    :attr:`LOOK_S` seconds: a worker that serves the run (its roots hold the run, or it holds one of
    its batches) whose presence says ``paused`` with ``store full at <path> (<free> free)``. The
    first such pause is said at once, then one line every :attr:`REPEAT_S` seconds while it lasts,
    and one line when it ends. The presence reaches the broker when the full store cannot take a
    status record; without a broker nothing is said.

    ``say(line)`` prints a line; ``clock`` is the monotonic clock (tests pass their own).
    """

    LOOK_S = 5.0
    REPEAT_S = 60.0

    def __init__(self, settings: Settings, broker_url: str | None, run_url: str, say, clock=time.monotonic):
        self.settings, self.broker_url, self.run_url, self.say, self.clock = settings, broker_url, run_url, say, clock
        self.since: float | None = None
        """Monotonic time the pause was first seen; None while none is."""
        self.pauses = 0
        """Pauses seen so far (each said once when it began)."""
        self._last_look: float | None = None
        self._last_said = 0.0
        self._client = None

    def paused(self) -> list[tuple[str, str]]:
        """``(worker, reason)`` of each live worker serving the run that is paused for a full store."""
        from hsx.broker import redis_client
        from producer.fleetview import alive_presences, serves

        if self._client is None:
            self._client = redis_client(self.broker_url)
        _now, live = alive_presences(self._client, self.settings.queue, self.settings.lease_s)
        return sorted((p.node or p.worker, p.paused_reason) for p in live
                      if p.state == "paused" and (p.paused_reason or "").startswith("store full")
                      and (serves(p, self.run_url) or any(t.run_url == self.run_url for t in p.tasks)))

    def ended(self) -> None:
        """Every batch has its marker: a pause said and not yet seen to end is over; say so."""
        from producer.statusview import fmt_duration

        if self.since is not None:
            self.say(f"resumed: the store has room again, after {fmt_duration(self.clock() - self.since)} paused")
            self.since = None

    def check(self) -> None:
        """Look (if :attr:`LOOK_S` passed since the last look) and say what changed; never raises."""
        from producer.statusview import fmt_duration

        if self.broker_url is None:
            return
        now = self.clock()
        if self._last_look is not None and now - self._last_look < self.LOOK_S:
            return
        self._last_look = now
        try:
            paused = self.paused()
        except Exception as exc:  # a broker hiccup: the next look
            log.debug("presences not read: %s", exc)
            return
        if paused:
            who = ", ".join(w for w, _ in paused[:4]) + (" ..." if len(paused) > 4 else "")
            reason = paused[0][1]
            if self.since is None:
                self.since, self._last_said = now, now
                self.pauses += 1
                self.say(f"paused: {reason}: {plural(len(paused), 'worker')} ({who}) hold their batches and go on by "
                         "themselves when there is room; free space there (nothing needs restarting)")
            elif now - self._last_said >= self.REPEAT_S:
                self._last_said = now
                self.say(f"still paused after {fmt_duration(now - self.since)}: {reason} ({who})")
        elif self.since is not None:
            self.say(f"resumed: the store has room again, after {fmt_duration(now - self.since)} paused")
            self.since = None


def progress_label(config) -> str:
    """The progress bar's name for a run's batches: ``regenerating`` for a regenerate run, else ``extracting``."""
    return "regenerating" if is_regenerate(config) else "extracting"


def wait_for_markers(planned: PlannedRun, workers: LocalWorkers | None, progress=None, poll_s: float | None = None,
                     reconcile=None, reconcile_after_s: float = 300.0, task=None, pauses: PauseWatch | None = None,
                     deaths=None, clock=time.monotonic) -> dict:
    """Block until every batch has a marker, or every unfinished batch has failed, or the workers
    died, or the run was cancelled (``producer cancel``: its ``cancelled.json``).

    ``task``: the progress task to show the markers on (``run``'s, shown since the first window);
    None: a new ``extracting`` task (``regenerating`` for a regenerate run, whose bar counts the
    answered conversations and their rate, :func:`progress_label`). ``pauses``: a :class:`PauseWatch` checked as it waits;
    ``deaths``: a :class:`producer.worker_events.WorkerEvents`, each worker death (and ready) said as it is seen;
    ``clock``: seconds, monotonic (the recent rate's and the reconcile's times).

    ``reconcile`` (a :class:`producer.reconcile.RunReconciler`) is called when every unfinished
    batch has failed, before giving up, and after ``reconcile_after_s`` seconds without a new
    marker (a worker process died holding a batch); waiting goes on when it enqueued something.

    Returns ``{"done": n, "failed": {batch: record}, "workers_died": bool, "cancelled": record or None}``.
    """
    run_store = planned.run_store
    by_name = {b.batch: b for b in planned.batches}
    if poll_s is None:
        # Each poll lists markers/ (1,000 keys per S3 page): poll big runs less often.
        poll_s = min(10.0, 0.5 + len(by_name) / 20_000)
    seen: set[str] = set()
    regen = is_regenerate(planned.config)
    # The plan is written: not "while planning" any more until the first marker (minutes, on a 27B).
    waiting = "waiting for the first batch to finish"
    if progress and task is None:
        task = progress.add_task(progress_label(planned.config), total=len(by_name), samples=0, tokens=0, info=waiting)
    elif progress:
        progress.update(task, total=len(by_name), info=waiting)
    tokens = samples = 0
    failed: dict = {}
    last_fail_check = 0.0
    last_progress = clock()
    arrivals: list[tuple[float, int]] = []  # (when this loop saw the marker, tokens): the recent rate
    first_look = True
    store_down_since = None
    while True:
        interrupts.check()  # a Ctrl-C whose KeyboardInterrupt a finalizer dropped stops the wait here
        try:
            done = done_batches(run_store) & set(by_name)
        except StoreError as exc:
            if not exc.transient:
                raise
            # The store is briefly unreachable (the workers retry and spill meanwhile): keep waiting.
            if store_down_since is None:
                store_down_since = clock()
                log.warning("the store does not answer (%s); still waiting for the markers", exc)
            time.sleep(poll_s)
            continue
        if store_down_since is not None:
            log.info("the store answers again after %.0f s", clock() - store_down_since)
            store_down_since = None
        now = clock()
        for b in done - seen:
            tokens += by_name[b].num_tokens
            samples += by_name[b].num_samples
            # The markers of the first look were made before it (by an earlier run this one resumes, or
            # while the plan was written): when is not known here, so they count as done but not in the
            # rate. Stamped with this look's time they made "tok/s now" 2.5-3.5x the steady rate after
            # a resume (issue 22, item 7): the next markers' span counted their tokens too.
            if not first_look:  # a regenerate batch's planned tokens are not what it generated: its answers count
                arrivals.append((now, by_name[b].num_samples if regen else by_name[b].num_tokens))
        first_look = False
        new_done = len(done - seen)
        seen |= done
        if new_done:
            last_progress = now
        if progress and new_done:
            # The rate of the last markers, not an average since the start: that would count planning,
            # the model load and the warm-up (producer/status.py recent_rate).
            rate = recent_rate(arrivals, now)
            # nan: "measuring" while more are to come; with none left a rate is never measured: none shown
            rate = rate if rate is not None else (float("nan") if set(by_name) - seen else None)
            if regen:
                progress.update(task, completed=len(seen), answers=samples, answers_s=rate)
            else:
                progress.update(task, completed=len(seen), samples=samples, tok_s=rate)
        remaining = set(by_name) - seen
        if not remaining:
            break
        if pauses is not None:
            pauses.check()
        if deaths is not None:
            deaths.check()
        if clock() - last_fail_check > 2.0:
            try:
                failed = _failed(run_store, seen)
                cancelled = Cancelled.read(run_store)
            except StoreError as exc:
                if not exc.transient:
                    raise
                time.sleep(poll_s)
                continue
            last_fail_check = clock()
            if cancelled is not None:
                return {"done": len(seen), "failed": failed, "workers_died": False,
                        "cancelled": cancelled.model_dump(exclude={"schema_version"})}
            if remaining <= set(failed):
                if reconcile is not None and reconcile():
                    last_progress = last_fail_check = clock()  # failures were cleared: wait for the redo
                    continue
                break
        if reconcile is not None and clock() - last_progress > reconcile_after_s:
            last_progress = clock()
            reconcile()
        if workers is not None and not workers.alive():
            if deaths is not None:
                deaths.check()  # the launcher's last words: the death after which it gave up
            return {"done": len(seen), "failed": _failed(run_store, seen), "workers_died": True, "cancelled": None}
        time.sleep(poll_s)
    if pauses is not None and seen >= set(by_name):
        pauses.ended()  # the pause ended since the last look (every batch is done): say so
    return {"done": len(seen), "failed": _failed(run_store, seen), "workers_died": False, "cancelled": None}


def stopping_line(workers: bool, embedded_broker: bool, signum: int | None = None) -> str:
    """What ``run`` prints at once on Ctrl-C / SIGTERM / SIGHUP (``signum``; None: Ctrl-C), before it
    stops what it started; a second signal of any of them kills the workers."""
    again = {signal.SIGTERM: "a second SIGTERM (or Ctrl-C)", signal.SIGHUP: "a SIGTERM"}.get(signum, "Ctrl-C again")
    steps = []
    if workers:
        steps.append(f"the workers finish the batches they have taken, up to one per task thread ({again} to kill "
                     "them now)")
    if embedded_broker:
        steps.append("the embedded broker stops (the same command again enqueues every batch without a marker)")
    return "stopping: " + ("; then ".join(steps) if steps else "nothing was started yet")


def _stop_started(local: LocalWorkers | None, broker, console, counted=None) -> None:
    """Stop the workers (warm shutdown) and the broker that ``run`` started; a second Ctrl-C kills the workers.
    ``counted()``: ``(done, total)`` batches of the run, said every 10 s while the workers finish theirs."""
    def say(waited_s: float) -> None:
        try:
            done, total = counted() if counted is not None else (None, None)
        except Exception:  # a store that does not answer now: the line without the count
            done = total = None
        count = f"{done:,}/{total:,} {noun(total, 'batch')} done; " if total is not None else ""
        console.print(f"stopping: {count}the workers are finishing the batches they hold ({waited_s:.0f} s)",
                      highlight=False)

    def killing() -> None:
        console.print(f"stopping: the workers did not finish within {WORKERS_STOP_TIMEOUT_S:.0f} s: killing them; the "
                      "batches they were running get no marker and are redone by the next run", highlight=False)

    try:
        if local is not None:
            local.stop(say=say if counted is not None else None, on_kill=killing)
    except KeyboardInterrupt:
        console.print("killing the workers: the batches they were running get no marker and are redone by the next run")
        local.kill()
        raise
    finally:
        if broker is not None:
            broker.stop()


def drop_leftover_messages(broker_url: str, queue: str) -> dict[str, int]:
    """Empty the embedded broker's database (queued and unacknowledged Celery messages, results).

    Only for the broker ``run`` starts for itself: one ``run`` at a time holds it (its state-dir
    lock), so nothing in it belongs to a live job. Returns how many extraction messages were
    dropped per run address (the task's first argument; ``"?"`` for a message that is not ours).
    """
    from hsx.broker import redis_client
    from hsx.brokerlayout import messages_by_run

    client = redis_client(broker_url)
    try:
        dropped = messages_by_run(client, queue)
        client.flushdb()
    finally:
        client.close()
    return dropped


class PlanningInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) while a run was planned; ``str()`` is the line the CLI prints."""


def plan_or_interrupted(opts: PlanOptions | PlanJob, settings: Settings, progress, on_window=None) -> PlannedRun:
    """:func:`producer.planner.plan_run` (or the run of a prepared :class:`PlanJob`); a Ctrl-C
    meanwhile raises :class:`PlanningInterrupted` saying how far planning got."""
    job = opts if isinstance(opts, PlanJob) else None
    try:
        if job is None:
            job = prepare_plan(opts, settings, progress)
        return job.run(progress, on_window)
    except KeyboardInterrupt:
        if job is None:  # loading the tokenizer, fingerprinting the dataset
            raise PlanningInterrupted("interrupted before planning: nothing was written; "
                                      "run the same command again to start over") from None
        tasks = {t.description: t for t in progress.tasks} if progress is not None else {}
        if tasks.get("tokenising") is not None:
            progress.stop_task(tasks["tokenising"].id)  # drawn as it was, not as a finished pulse
        written = [w for w in job.windows if exists(job.run_store, window_key(w.name))]
        if not written and not job.claimed_run:
            raise PlanningInterrupted("interrupted while tokenising the dataset, before the plan's first window: "
                                      "nothing was written; run the same command again to start over") from None
        if not written:
            raise PlanningInterrupted("interrupted while writing the plan's first window: status says the planning "
                                      "did not finish; run the same command again: it plans the run from the start") from None
        batches = sum(len(w.batches) for w in written)
        samples = sum(w.num_samples for w in written)
        raise PlanningInterrupted(
            f"interrupted while planning: {plural(len(written), 'window')} of the plan ({plural(samples, 'sample')} in "
            f"{plural(batches, 'batch')}) {'is' if len(written) == 1 else 'are'} in the store, its batches enqueued; "
            "run the same command again: it resumes after "
            f"{'it' if len(written) == 1 else 'them'}") from None


def _plan_report(planned: PlannedRun, done_before: set[str]) -> dict:
    return {"run_id": planned.config.run_id, "address": planned.run_url, "plan": planned.stats,
            "dataset_ignored": planned.config.dataset.get("ignored", []), "plan_reused": planned.reused, "batches_total": len(planned.batches),
            "batches_already_done": len(done_before), "batches_enqueued": 0}


class _Launch:
    """``on_window`` of ``run``: at the first window in the store, start the embedded broker (if
    no broker URL is set) and the local workers, then enqueue each window's batches.

    Nothing starts before the first window: a dataset with no usable record, or a refused config,
    starts no process; from the first window on, the workers load the model while the rest of the
    dataset is tokenised.
    """

    def __init__(self, settings: Settings, opts: PlanOptions, console, broker, workers: int | None, progress):
        self.settings, self.opts, self.console, self.workers, self.progress = settings, opts, console, workers, progress
        self.broker = broker
        self.broker_url = settings.broker_url
        self.local: LocalWorkers | None = None
        self.sender: WindowSender | None = None
        self.task = None  # "extracting" ("regenerating"): batches planned so far, and their markers
        self.planned = 0
        self.pauses: PauseWatch | None = None  # a full store, said while the plan is still written too
        self.deaths = None  # producer.worker_events.WorkerEvents: each worker death (and ready), said as it happens

    def __call__(self, job: PlanJob, batches: list[BatchSummary]) -> None:
        interrupts.check()  # a Ctrl-C meanwhile starts nothing more, enqueues nothing more
        if self.sender is None:
            self._start(job)
        self.sender(job, batches)
        self.planned += len(batches)
        self.tick(job)

    def tick(self, job: PlanJob) -> None:
        """The ``extracting`` (``regenerating``) bar while the plan is written: markers of the batches
        planned so far (the planner calls this every few seconds, and after each window)."""
        interrupts.check()
        if self.pauses is not None:
            self.pauses.check()
        if self.deaths is not None:
            self.deaths.check()
        if self.progress is None or self.sender is None:
            return
        if self.task is None:
            self.task = self.progress.add_task(progress_label(job.config), total=None, samples=0, tokens=0)
        try:
            done = len(done_batches(job.run_store))
        except Exception:  # only a progress figure: the store may be slow to list
            done = None
        self.progress.update(self.task, total=self.planned, **({} if done is None else {"completed": done}),
                             info="plan reused" if getattr(job, "reused", False) else "while planning")

    def _start(self, job: PlanJob) -> None:
        settings, console = self.settings, self.console
        if not self.broker_url:
            self.broker.start()
            self.broker_url = self.broker.url
            # Messages left by an interrupted run or a `reconcile` (waiting or unacknowledged) would
            # be run by this run's workers, which load this run's model. Every run enqueues every
            # batch it lacks, so dropping them loses nothing: the next run of that job enqueues them.
            for run_url, n in sorted(drop_leftover_messages(self.broker_url, settings.queue).items()):
                if run_url == job.run_url:
                    continue  # this run's own: enqueued again below
                console.print(f"[dim]embedded broker: dropped {n} queued batch message(s) of {mask_url(run_url)}, "
                              "left by an interrupted run or a reconcile; run that job's `producer run` again to "
                              "redo them[/]", soft_wrap=True)
            console.print(f"[dim]embedded broker: valkey-server on {self.broker.socket_path} "
                          f"(AOF in {settings.broker_state_dir})[/]", soft_wrap=True)
        log_path = workers_log_path(settings, job.config.run_id)
        env = worker_env(settings, self.broker_url, self.opts.model, job.config.batch_tokens)
        self.local = LocalWorkers(env, log_path, count=self.workers)
        # soft_wrap: lines with commands and paths to copy are never broken
        console.print(f"[dim]workers: python -m workers (log: {log_path})[/]", soft_wrap=True)
        console.print(f"[dim]follow it from another terminal: python -m producer status {job.run_url} --watch "
                      "(or python -m producer flower)[/]", soft_wrap=True)
        self.sender = WindowSender(settings, self.broker_url, self.progress)
        self.pauses = PauseWatch(settings, self.broker_url, job.run_url,
                                 lambda line: console.print(line, highlight=False, soft_wrap=True))
        from producer.worker_events import WorkerEvents

        events = getattr(self.local, "events_path", None)  # a stand-in for LocalWorkers (tests) may have none
        self.deaths = events and WorkerEvents(
            events, job.run_store, lambda line: console.print(line, style="red", highlight=False, soft_wrap=True),
            say_info=lambda line: console.print(line, style="dim", highlight=False, soft_wrap=True),
            log_path=log_path)


def run_job(opts: PlanOptions, settings: Settings, console, *, workers: int | None = None, progress_factory=None) -> tuple[int, dict]:
    """Plan (streamed), start the broker and workers at the first window, enqueue each window's
    batches as it is written, extract every batch, stop what we started. Returns (exit code, report).
    """
    t0 = time.perf_counter()
    claimed = None
    if settings.broker_url:
        check_broker(settings.broker_url)  # a bad broker URL is refused before planning
    try:
        try:
            if settings.gpus_per_worker > 1:  # a K the model cannot be split into: refused before planning
                from workers.group import check_group

                check_group(opts.model, settings)
            job = prepare_plan(opts, settings)  # every refusal of the request before anything starts (writes nothing)
            if not settings.broker_url and settings.broker_state_dir.is_dir():
                # another `run` on this machine's embedded broker: refused now, not after tokenising the dataset,
                # and after the request's own errors (a wrong option is said as such, not as a busy broker).
                # No state dir yet: no other run holds it, and a refused config leaves nothing behind.
                try:
                    claimed = EmbeddedBroker(settings.broker_state_dir).claim()
                except BaseException:
                    job.discard()
                    raise
            interrupts.check()  # a Ctrl-C while the dataset was opened (its KeyboardInterrupt dropped): start nothing
        except KeyboardInterrupt:
            raise PlanningInterrupted("interrupted before planning: nothing was written; "
                                      "run the same command again to start over") from None
        if plan_complete(job.run_store):
            planned = job.run()
            done_before = done_batches(planned.run_store) & {b.batch for b in planned.batches}
            if len(done_before) == len(planned.batches):
                if claimed is not None:
                    claimed.stop_orphan()  # the broker of a killed run is stopped even when nothing is left
                    claimed.release()
                report = _plan_report(planned, done_before)
                if is_regenerate(planned.config):  # its table says what was answered, as after a run that worked
                    report["answers"] = regenerated_answers(planned.run_store, done_before)
                report["seconds"] = round(time.perf_counter() - t0, 2)
                return 0, report
    except BaseException:
        if claimed is not None:
            claimed.release()
        raise

    broker = claimed  # stopped (and its lock released) in the finally below, started or not
    if broker is None and not settings.broker_url:
        broker = EmbeddedBroker(settings.broker_state_dir)
    launch = None
    planned = None
    interrupted: KeyboardInterrupt | None = None
    draining = False  # cancelled: the workers finish what they hold, the user told so
    code = 0
    try:
        with progress_factory() as progress:
            launch = _Launch(settings, opts, console, broker, workers, progress)
            try:
                planned = plan_or_interrupted(job, settings, progress, on_window=launch)
            except RunCancelled:  # `producer cancel` while it planned: stop here, as after the plan
                planned = None
            sender = launch.sender
            if planned is None:
                report, waited = _cancelled_while_planning(job, sender), None
            else:
                report = _plan_report(planned, set(sender.result.already_done) if sender else set())
                report["batches_enqueued"] = len(sender.result.enqueued) if sender else 0
                report["resumed"] = sender.result.resumed if sender else None
                reconciler = RunReconciler(planned.run_store, settings, launch.broker_url)
                waited = wait_for_markers(planned, launch.local, progress, reconcile=reconciler, task=launch.task,
                                          pauses=launch.pauses, deaths=launch.deaths)
                report["reconciled"] = reconciler.redone
        if waited is None:
            code = 1
        else:
            report["failed"] = waited["failed"]
            report["cancelled"] = waited["cancelled"]
            if waited["workers_died"]:
                report["workers_log_tail"] = launch.local.log_tail()
                report["workers_exit"] = launch.local.exit_description()
                report["workers_gave_up"] = launch.deaths.gave_up if launch.deaths is not None else None
                code = 1
            elif waited["failed"] or waited["cancelled"]:
                code = 1
            if waited["cancelled"] and launch.local is not None:  # said now: the workers may take a while
                draining = True
                by = waited["cancelled"]
                console.print(f"cancelled ({by.get('by')}, {by.get('at')}): no batch of the run starts; the workers "
                              "finish the batches they hold" + (" (--now: stopped before their marker)" if by.get("now")
                                                               else "") + ", then stop", highlight=False)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (the CLI turns it into KeyboardInterrupt)
        local = launch.local if launch is not None else None
        console.print(stopping_line(local is not None, broker is not None and broker.proc is not None,
                                    interrupts.received()))
        if planned is not None and not isinstance(exc, PlanningInterrupted):
            # counted by the CLI once the workers have stopped (the finally below): their last batches count
            run_store, names = planned.run_store, {b.batch for b in planned.batches}
            exc.batches_done = lambda: (len(done_batches(run_store) & names), len(names))
        interrupted = exc
        raise
    finally:
        counted = None
        if interrupted is not None or draining:  # a stop the user waits on: said as it drains
            counted = lambda: (None, None)  # noqa: E731 (stopped while planning: no batch list to count yet)
            if planned is not None:
                names_all = {b.batch for b in planned.batches}
                counted = lambda: (len(done_batches(planned.run_store) & names_all), len(names_all))  # noqa: E731
        try:
            _stop_started(launch.local if launch is not None else None, broker, console, counted)
        except KeyboardInterrupt as again:  # a second Ctrl-C killed the workers: the first one's account stands
            if isinstance(interrupted, PlanningInterrupted):
                raise PlanningInterrupted(str(interrupted)) from None
            if hasattr(interrupted, "batches_done"):
                again.batches_done = interrupted.batches_done
            raise
    if planned is not None:
        done = done_batches(planned.run_store) & {b.batch for b in planned.batches}
        report["batches_done"] = len(done)
        if is_regenerate(planned.config):
            report["answers"] = regenerated_answers(planned.run_store, done)
    report["seconds"] = round(time.perf_counter() - t0, 2)
    return code, report


def regenerated_answers(run_store, done: set[str]) -> dict:
    """What the target generated in a regenerate run's done batches ``done``, from their markers
    (:class:`hsx.regen.RegenMarker`): ``{"batches", "conversations", "completion_tokens", "unfinished",
    "stop_cut", "engines": {engine: batches}}``; ``unfinished``: conversations with an answer cut at
    ``--max-new-tokens`` or a prompt too long (``--drop-unfinished`` skips them downstream); ``stop_cut``:
    those with an answer cut before a ``--stop`` string (kept; its end-of-turn token unsupervised)."""
    out = {"batches": 0, "conversations": 0, "completion_tokens": 0, "unfinished": 0, "stop_cut": 0, "engines": {}}
    for marker in read_markers(run_store, sorted(done), record=RegenMarker).values():
        if isinstance(marker, Exception):  # `verify` names it; a summary line does not stop for it
            continue
        out["batches"] += 1
        out["conversations"] += int(marker.num_samples or 0)
        out["completion_tokens"] += int(marker.supervised_tokens or 0)
        out["unfinished"] += int(marker.unfinished or 0)
        out["stop_cut"] += int(marker.stop_cut or 0)
        engine = marker.engine or "unknown"
        out["engines"][engine] = out["engines"].get(engine, 0) + 1
    return out


def run_regenerated(opts: PlanOptions, regen: dict, settings: Settings, console, *, workers=None,
                    progress_factory=None) -> tuple[int, dict, dict | None]:
    """``producer run DATASET --regenerate ...``: the regenerate run of ``opts`` with ``regen``, then,
    once every one of its batches is done, the extraction of its conversations (``opts``' layers and
    options; ``opts.drop_unfinished``). Returns ``(exit code, the regenerate run's report, the
    extraction's report or None when the first stage did not finish)``. A Ctrl-C stops the stage
    running; the same command resumes both (each is a run: its done batches keep their markers)."""
    # The regenerate stage captures nothing and checks no layer option: the extraction's layers are
    # checked here, before any GPU work, not after the whole regenerate stage.
    check_extraction_layers(opts, settings)
    first = dataclasses.replace(opts, regenerate=regen, drop_unfinished=False, run_id=None)
    code, report = run_job(first, settings, console, workers=workers, progress_factory=progress_factory)
    if code != 0 or report.get("batches_done", report.get("batches_already_done")) != report.get("batches_total"):
        return code or 1, report, None
    interrupts.check()  # a Ctrl-C as the first stage ended (its KeyboardInterrupt dropped): no second stage
    second = dataclasses.replace(opts, dataset=report["address"], regenerate=None, limit=None, sample=None,
                                 shuffle=False, seed=None, split=None, subset=None)
    code, extracted = run_job(second, settings, console, workers=workers, progress_factory=progress_factory)
    return code, report, extracted


def _cancelled_while_planning(job: PlanJob, sender: WindowSender | None) -> dict:
    """``run``'s report when ``producer cancel`` stopped the planning (the windows written so far count)."""
    batches = {b.batch for w in job.windows[:job.written] for b in w.batches}
    record = Cancelled.read(job.run_store)
    return {"run_id": job.config.run_id, "address": job.run_url, "plan": None, "plan_reused": False,
            "batches_total": len(batches), "batches_already_done": len(sender.result.already_done) if sender else 0,
            "batches_enqueued": len(sender.result.enqueued) if sender else 0,
            "batches_done": len(done_batches(job.run_store) & batches), "reconciled": {}, "failed": {},
            "cancelled": record.model_dump(exclude={"schema_version"}) if record is not None else {"by": "?", "at": None}}
