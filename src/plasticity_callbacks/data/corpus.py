"""The embedded default corpus: the running interpreter's own standard library source.

Every machine with Python has it, so the default job needs no download. File lists are
sorted and split by a hash of each file's relative path, so the split is the same on every
machine with the same Python, and does not change when other files are added or removed.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
import zlib
from pathlib import Path

# Tests, vendored third-party code and tooling that is not ordinary library code.
EXCLUDED_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_vendor", "ensurepip"}


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def top_level_package(relative: Path) -> str:
    """``json/decoder.py`` → ``json``; ``os.py`` → ``os``."""
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def stdlib_files(packages: list[str] | None = None, exclude_packages: list[str] | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library, without tests and vendored code.

    ``packages`` / ``exclude_packages`` are ``fnmatch`` patterns on the top-level package
    name (e.g. ``["[a-k]*"]``), used to cut the library into phases.
    """
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune while walking: site-packages alone can be gigabytes.
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_PARTS and not d.startswith("config-"))
        for filename in filenames:
            if not filename.endswith(".py") or filename.startswith(("test_", "_sysconfigdata")):
                continue
            rel = Path(dirpath, filename).relative_to(root)
            pkg = top_level_package(rel)
            if packages is not None and not any(fnmatch.fnmatchcase(pkg, p) for p in packages):
                continue
            if exclude_packages is not None and any(fnmatch.fnmatchcase(pkg, p) for p in exclude_packages):
                continue
            files.append(root / rel)
    files.sort()
    return files


def glob_files(pattern: str | list[str]) -> list[Path]:
    """Files matching one or several globs (``**`` allowed), sorted; directories skipped."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    found = sorted({Path(p) for pat in patterns for p in glob.glob(str(Path(pat).expanduser()), recursive=True)})
    return [p for p in found if p.is_file()]


def is_validation(path: Path, root: Path | None, val_fraction: float) -> bool:
    """Deterministic split by file: a CRC of the path relative to ``root`` picks the held-out files."""
    key = str(path.relative_to(root) if root is not None and path.is_relative_to(root) else path)
    return (zlib.crc32(key.encode()) % 10_000) < val_fraction * 10_000


def split_files(files: list[Path], val_fraction: float, root: Path | None = None) -> tuple[list[Path], list[Path]]:
    train = [f for f in files if not is_validation(f, root, val_fraction)]
    val = [f for f in files if is_validation(f, root, val_fraction)]
    if val_fraction > 0 and len(files) > 1:  # tiny corpora: each side keeps at least one file
        if not val:
            train, val = files[:-1], files[-1:]
        elif not train:
            train, val = val[:1], val[1:]
    return train, val


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")
