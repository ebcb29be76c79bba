"""What the distribution installs: four top-level import names, ``hsx`` (the shared run format,
once ``core``), ``producer``, ``workers`` and ``settings`` (the design card's top level), and no
other installed distribution provides any of them."""

from __future__ import annotations

import importlib
import importlib.metadata
import tomllib
from pathlib import Path

from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"hsx", "producer", "workers", "settings"}


def _installed_top_level() -> set[str]:
    """The top-level names pyproject's setuptools tables put into site-packages."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = find_packages(str(ROOT), include=tool["packages"]["find"]["include"])
    return {p.split(".")[0] for p in packages} | set(tool.get("py-modules", []))


def test_the_distribution_installs_exactly_its_four_top_level_names():
    assert _installed_top_level() == TOP_LEVEL


def test_no_other_installed_distribution_provides_one_of_our_names():
    """A second provider of ``settings`` or ``hsx`` would shadow ours, depending on install order."""
    providers = importlib.metadata.packages_distributions()
    for name in sorted(TOP_LEVEL):
        others = sorted(set(providers.get(name, [])) - {"hsx"})
        assert not others, f"top-level name {name!r} is also installed by {others}"


def test_each_name_imports_from_this_checkout():
    for name in sorted(TOP_LEVEL - {"workers"}):  # importing workers needs HSX_BROKER_URL (workers/app.py)
        module = importlib.import_module(name)
        assert Path(module.__file__).resolve().is_relative_to(ROOT), f"{name} imports from {module.__file__}"
