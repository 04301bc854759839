"""The cache's vocabulary shared by fa4gen.cache and fa4gen.cache_archive: its errors and warnings,
the entry type, the on-disk constants and the small file helpers (no torch, no cutlass).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

META_NAME = "meta.json"

FORMAT_VERSION = 1

MAX_META_BYTES = 2**20  # a meta.json is read into memory whole; real ones are ~2 KiB

_KEY_RE = re.compile(r"[0-9a-f]{64}")

_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class CacheError(RuntimeError):
    """Base class of every error raised by the kernel cache."""


class CacheMiss(CacheError):
    """get_or_build(no_compile=True) found no valid entry; the message comes from the caller."""


class UntrustedCacheError(CacheError):
    """Someone else can write the cache, so loading a kernel from it could run their code."""


class CacheFullError(CacheError):
    """The cache's filesystem filled up while an entry was written; nothing was kept."""


class ReadOnlyCacheError(CacheError):
    """The cache lacks an entry (or was asked to change) and this process cannot write it."""


class CacheWarning(RuntimeWarning):
    """Base class of the cache's warnings (each message is one line)."""


class CacheCorruptionWarning(CacheWarning):
    """An entry failed verification and was treated as missing."""


class CacheSizeWarning(CacheWarning):
    """Entries in use or recently used exceed the size limit, so they were kept."""


@dataclass(frozen=True)
class CacheEntry:
    """A verified entry: `path` holds the artifact files listed in meta["files"]."""

    key: str
    path: Path
    meta: dict

    def file(self, name: str) -> Path:
        files = self.meta.get("files", {})
        if name not in files:
            raise KeyError(f"cache entry {self.key} has no file {name!r}; it has {sorted(files)}")
        return self.path / name


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"invalid cache key {key!r}: expected 64 lowercase hex digits (make_key)")
    return key


def _is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception's cause/context chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _write_json(path: Path, doc: dict) -> None:
    """Create `path` (which must not exist) holding `doc`, flushed to disk."""
    data = memoryview(json.dumps(doc, sort_keys=True, indent=1).encode("utf-8"))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        while data:
            data = data[os.write(fd, data) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _rmtree(path: Path) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _mkdirs(path: Path, mode: int) -> None:
    """mkdir -p: the last directory gets `mode`, missing parents 0o755 (the umask applies)."""
    missing = []
    while not os.path.isdir(path) and path.parent != path:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, mode if directory is missing[0] else 0o755)


def _safe_parts(name: str) -> tuple[str, ...] | None:
    """Components of a relative POSIX path that stays inside its directory, else None."""
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name or "\0" in name:
        return None
    parts = PurePosixPath(name).parts
    return None if not parts or ".." in parts or "." in parts else parts
