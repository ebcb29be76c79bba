"""Hugging Face datasets as sources: a hub id (``org/name``), a ``save_to_disk`` directory, or a
local directory in the hub's layout, read through the ``datasets`` library in streaming mode.

Not written yet: :func:`open_hf_source` refuses with a clear error.
"""

from __future__ import annotations

import re
from pathlib import Path

from hsx.errors import BadDataset

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_hf_source(source: str) -> bool:
    """True when ``source`` names a Hugging Face dataset rather than files our readers take."""
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "dataset_info.json").is_file() and (path / "state.json").is_file():
            return True
        return (path / "dataset_dict.json").is_file()
    return not path.exists() and bool(_HUB_ID.match(source))


def open_hf_source(source: str, options, *, cache_dir=None):
    raise BadDataset(f"{source!r}: Hugging Face datasets are not supported yet")
