"""Where dyspec keeps files: the cache folder (what is converted, measured or fitted once per machine and
read after) and what ships in the package (`SHIPPED`: drafts, acceptance heads, Sequoia's vectors)."""

from __future__ import annotations

import os
from pathlib import Path

SHIPPED = Path(__file__).with_name("shipped")


def cache_dir() -> Path:
    root = os.environ.get("DYSPEC_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dyspec"
    return Path(root)


def write_cache(path: Path, text: str) -> None:
    """Write a cache file whole or not at all: processes that share the cache (test workers, an app
    and a notebook) may measure the same thing at once, and a reader must never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
