"""The training corpus of the djax-tiny models: the Python standard library's *.py files, split by file name.

A file is held out when the CRC-32 of its path relative to the stdlib root (posix spelling, e.g.
`json/decoder.py`) is 0 modulo HELDOUT_MODULUS: a split every machine computes alike, whatever the
order of directory listings. Installed third-party code (site-packages), the interpreter's
build-specific files and files that are not UTF-8 are left out.
"""

from __future__ import annotations

import sysconfig
import zlib
from pathlib import Path

HELDOUT_MODULUS = 32  # about 3% of the files are held out


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    """Whether the file at stdlib-relative posix path `rel` belongs to the held-out split."""
    return zlib.crc32(rel.encode()) % HELDOUT_MODULUS == 0


def _skipped(rel: Path) -> bool:
    top = rel.parts[0]
    return (
        top in ("site-packages", "dist-packages")
        or top.startswith("config-")
        or rel.name.startswith("_sysconfigdata")
    )


def corpus_files(root: str | Path | None = None, split: str = "train") -> list[tuple[str, str]]:
    """(relative path, text) of every corpus file in `split` ("train", "heldout" or "all"), sorted by path."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be train, heldout or all; got {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _skipped(rel) or not path.is_file():
            continue
        name = rel.as_posix()
        if split != "all" and is_heldout(name) != (split == "heldout"):
            continue
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append((name, text))
    if not out:
        raise FileNotFoundError(f"no {split} *.py files under {root}")
    return out
