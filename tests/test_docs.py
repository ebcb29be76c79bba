"""The README and docs/ say what the code does: every setting is in the README's settings table,
every option of its options table is one the CLI takes, every producer subcommand it names exists,
every link between the documents resolves, and nothing names a path outside the repository."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from settings import Settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))


def _section(text: str, heading: str) -> str:
    """The text of the README section ``## heading`` up to the next ``## ``."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def _help(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", *args, "--help"], capture_output=True, text=True, check=True,
                          cwd=ROOT).stdout


def test_every_setting_is_in_the_readme_settings_table_and_every_row_is_a_setting():
    """HSX_FAULTS is the tests' own (docs/testing.md), not a user's setting."""
    table = _section(README.read_text(), "Settings")
    rows = [line for line in table.splitlines() if line.startswith("| `HSX_")]
    documented = {v for row in rows for v in re.findall(r"`(HSX_[A-Z0-9_]+)`", row.split(" | ")[0])}
    settings = {f"HSX_{name.upper()}" for name in Settings.model_fields} - {"HSX_FAULTS"}
    assert settings - documented == set(), "settings missing from the README's table"
    assert documented - settings == set(), "rows of the README's table that are no setting"


def test_every_option_of_the_readme_options_table_is_one_the_producer_takes():
    table = _section(README.read_text(), "Options")
    named = {o for line in table.splitlines() if line.startswith("| `")
             for o in re.findall(r"(--[a-z][a-z-]*)", line.split(" | ")[0])}
    assert len(named) > 20, "the options table was not found"
    taken = set(re.findall(r"(--[a-z][a-z-]*)", _help("producer", "run") + _help("producer", "enqueue")))
    assert named - taken == set(), "options the README lists that neither run nor enqueue takes"


def test_every_producer_subcommand_the_documents_name_exists():
    text = "\n".join(p.read_text() for p in [README, *DOCS])
    named = set(re.findall(r"python -m producer ([a-z][a-z-]+)", text)) | set(re.findall(r"`producer ([a-z][a-z-]+)", text))
    listed = set(re.search(r"\{([a-z,-]+)\}", _help("producer")).group(1).split(","))
    assert named and named - listed == set(), "producer subcommands the documents name that do not exist"
    workers = set(re.findall(r"python -m workers (--[a-z-]+)", text))
    assert workers - set(re.findall(r"(--[a-z][a-z-]*)", _help("workers"))) == set()


def test_links_between_the_documents_resolve():
    for doc in [README, *DOCS]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


def test_nothing_names_a_path_outside_the_repository():
    outside = re.compile(r"/work/|\.\./shared|FIELD-NOTES|/home/\w|\.\./\.\./\.\.")
    files = [README, *DOCS, ROOT / "docker-compose.yml", ROOT / "Dockerfile", ROOT / "settings.py"]
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
             for n, line in enumerate(p.read_text().splitlines(), 1) if outside.search(line)]
    assert found == []
