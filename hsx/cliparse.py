"""The command-line parser both entry points use (``python -m producer``, ``python -m workers``)."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (the option, the value, the rule) and a pointer to
    ``--help``, not argparse's whole usage block first, as every other refusal of a request is.
    Subcommands' parsers are of this class too (``add_subparsers`` makes them of the parent's).
    Exits with code 2, as argparse does."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(`{self.prog} --help` lists every option)\n")
