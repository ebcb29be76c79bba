"""The rate right after a resume (issue 22, item 7): ``producer run``'s "tok/s now" counts only the
markers it saw being made, not those an earlier run left (they were stamped with the first look's
time and made the rate 2.5-3.5x the steady one).

A real run of about ten batches on the shared worker, stopped partway (the markers of its second
half deleted, as a run stopped there leaves it), then its plan reused as ``producer run`` reuses it.
"""

from __future__ import annotations

import shutil

import pytest

from jobfixtures import clean_env, cli_json

from hsx.layout import marker_key
from hsx.plan import read_batch_list
from hsx.store import open_store
from producer.planner import PlanOptions, plan_run
from producer.run import wait_for_markers
from settings import Settings

JOB = dict(dataset="sharegpt", model="tiny-qwen3.5", limit=24, max_length=256, batch_tokens=512)
ARGS = ["sharegpt", "--model", "tiny-qwen3.5", "--limit", "24", "--max-length", "256", "--batch-tokens", "512"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, shared_worker, tiny_cache) -> dict:
    """A real ``producer run`` of :data:`ARGS`, every batch done."""
    tmp = tmp_path_factory.mktemp("resume-rate")
    env = clean_env(cache_dir=tiny_cache, state_dir=tmp / "state", spool_dir=tmp / "spool")
    report = cli_json(shared_worker.producer(["run", *ARGS, "--output", str(tmp / "out"), "--json"], env))
    assert report["batches_done"] == report["batches_total"] >= 8, report
    return {"dir": tmp / "out" / report["run_id"], "report": report, "env": env}


class ResumedWorkers:
    """The progress ``wait_for_markers`` draws on, and the resumed run's workers: after each update
    (each look that found a new marker) one more batch is certified, 10 s later on its clock.
    ``rates``: the "tok/s now" of each update."""

    def __init__(self, store, pending: list[tuple[str, bytes]]):
        self.store, self.pending, self.t, self.rates = store, pending, 0.0, []

    def clock(self) -> float:
        return self.t

    def add_task(self, *args, **kwargs):
        return 0

    def update(self, task, **fields):
        self.rates.append(fields.get("tok_s"))
        if self.pending:
            batch, marker = self.pending.pop(0)
            self.t += 10.0
            self.store.write(marker_key(batch), marker)


def test_tok_s_now_after_a_resume_counts_only_the_markers_made_since(finished, tmp_path, tiny_cache):
    """Half the batches were done before the resume: the first look finds their markers and counts
    them as done, not as made at that moment. Then one batch every 10 s: "tok/s now" is the tokens
    of the markers after the first new one over their span (the first only opens the window, as
    its work began before the resume), never a figure that counts the earlier run's tokens."""
    run_dir = tmp_path / "out" / finished["report"]["run_id"]
    shutil.copytree(finished["dir"], run_dir, ignore=shutil.ignore_patterns(".hsx-tmp-*"))  # the shared worker still writes its presence
    store = open_store(str(run_dir))
    batches = read_batch_list(store)
    half = len(batches) // 2
    later = batches[half:]
    pending = [(b.batch, store.read(marker_key(b.batch))) for b in later]
    for b in later:
        store.delete(marker_key(b.batch))  # the run stopped here

    planned = plan_run(PlanOptions(**JOB, output=str(tmp_path / "out")), Settings(_env_file=None, cache_dir=tiny_cache))
    assert planned.reused and planned.run_url.rstrip("/").endswith(run_dir.name)
    workers = ResumedWorkers(store, pending)
    waited = wait_for_markers(planned, None, progress=workers, poll_s=0.01, clock=workers.clock)
    assert waited["done"] == len(batches) and not waited["failed"]

    # update 0: the first look (the earlier run's markers); update 1: the first new marker, which only
    # opens the window; update k >= 2: k new markers 10 s apart.
    rates = workers.rates
    assert len(rates) == len(later) + 1, rates
    assert all(r != r for r in rates[:2]), f"no rate before two markers made since the resume: {rates}"
    tokens = [b.num_tokens for b in later]
    for k in range(2, len(later) + 1):
        steady = sum(tokens[1:k]) / (10.0 * (k - 1))
        assert rates[k] == pytest.approx(steady), (k, rates, steady)


def test_a_run_whose_plan_is_reused_never_says_while_planning(finished, shared_worker, tmp_path):
    """The same ``producer run`` again over a run stopped halfway: its plan is reused whole, and its
    bar (in a log: the plain ``progress`` lines) says so, never "while planning" (a new user read
    that a resumed run was planning again); it then finishes the other half."""
    run_dir = tmp_path / "out" / finished["report"]["run_id"]
    shutil.copytree(finished["dir"], run_dir, ignore=shutil.ignore_patterns(".hsx-tmp-*"))
    store = open_store(str(run_dir))
    batches = read_batch_list(store)
    for b in batches[len(batches) // 2:]:
        store.delete(marker_key(b.batch))  # the run stopped here
    proc = shared_worker.producer(["run", *ARGS, "--output", str(tmp_path / "out")], finished["env"])
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-2000:]
    progress = [line for line in said.splitlines() if line.startswith("progress ")]
    assert any("extracting" in line and "plan reused" in line for line in progress), progress
    assert "while planning" not in said, said[-2000:]
