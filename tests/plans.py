"""Small helpers of the planning tests (not fixtures): options, settings, and a plan's files."""

from __future__ import annotations

from pathlib import Path

from producer.planner import PlanOptions
from settings import Settings


def plan_settings(tiny_cache) -> Settings:
    return Settings(_env_file=None, cache_dir=tiny_cache)


def plan_options(output, dataset="sharegpt", **kw) -> PlanOptions:
    """Options for ``tiny-qwen3.5`` into ``output``; ``max_length`` 256 unless given."""
    kw.setdefault("max_length", 256)
    return PlanOptions(dataset=str(dataset), model="tiny-qwen3.5", output=str(output), **kw)


def plan_files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the plan that does not say when or how fast it was made (stats.json does)."""
    return {p.relative_to(run_dir).as_posix(): p.read_bytes() for p in sorted((run_dir / "plan").rglob("*"))
            if p.is_file() and p.name != "stats.json"}
