"""On-disk cache of compiled kernel artifacts, shared safely between processes and machines.

Layout under the root: ``entries/<key>/`` holds one kernel's files plus ``meta.json`` (written
last: the commit marker); ``index/`` is a diskcache.Cache of key -> meta + last use (advisory, may
be deleted at will); ``locks/<key>.lock`` serialises builds of a key with fcntl.flock; ``tmp/`` is
staging on the same filesystem. An entry exists iff its meta.json parses, names the key, and every
file it lists hashes to the recorded sha256. Entries appear only by atomic rename of a complete
directory, so readers see nothing or a whole entry; anything else counts as missing.

This module is on the hot path of loading a kernel: it must never import torch or cutlass.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sqlite3
import stat
import time
import warnings
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Collection, Iterator

DEFAULT_ENV = "FA4GEN_CACHE_DIR"
SIZE_LIMIT_ENV = "FA4GEN_CACHE_SIZE_LIMIT"
TRUSTED_ENV = "FA4GEN_CACHE_TRUSTED"
DEFAULT_SIZE_LIMIT = 10 * 1024**3
META_NAME = "meta.json"
FORMAT_VERSION = 1
RESERVED_META_KEYS = frozenset({"files", "created", "size", "last_use"})

_KEY_RE = re.compile(r"[0-9a-f]{64}")
_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgtp]?)(?:i?b)?", re.IGNORECASE)
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_RACY_NS = 2_000_000_000  # files modified more recently than this are re-hashed on every lookup
_VERIFIED: dict[tuple, None] = {}  # per-process memo of verified (path, file stats, digests)
_VERIFIED_MAX = 4096
_STALE_IMPORT_S = 24 * 3600

log = logging.getLogger(__name__)


class CacheError(RuntimeError):
    """Base class of every error raised by the kernel cache."""


class CacheMiss(CacheError):
    """get_or_build(no_compile=True) found no valid entry; the message comes from the caller."""


class UntrustedCacheError(CacheError):
    """Someone else can write the cache, so loading a kernel from it could run their code."""


class CacheFullError(CacheError):
    """The cache's filesystem filled up while an entry was written; nothing was kept."""


class CacheCorruptionWarning(RuntimeWarning):
    """An entry failed verification and was treated as missing."""


def default_cache_root() -> Path:
    """$FA4GEN_CACHE_DIR, else $XDG_CACHE_HOME/fa4gen, else ~/.cache/fa4gen."""
    explicit = os.environ.get(DEFAULT_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg and os.path.isabs(xdg):  # the XDG spec says relative values must be ignored
        return Path(xdg) / "fa4gen"
    return Path.home() / ".cache" / "fa4gen"


def make_key(parts: dict) -> str:
    """The one place a cache key is built: sha256 hex of the canonical JSON of `parts`."""
    if not isinstance(parts, dict):
        raise TypeError(f"make_key expects a dict, got {type(parts).__name__}")
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def parse_size(value: int | str, source: str = "size limit") -> int:
    """Bytes from an int or a string like "1048576", "500M", "10G", "1.5GiB" (binary units)."""
    match = None if isinstance(value, (int, bool)) else _SIZE_RE.fullmatch(str(value).strip())
    if match is not None:
        value = int(float(match.group(1)) * 1024 ** " kmgtp".index(match.group(2).lower() or " "))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: cannot use {value!r}; expected a byte count such as "
                         f"1073741824 or a number with a K/M/G/T suffix such as 500M or 10G")
    return value


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


def _check_meta(meta: dict) -> dict:
    if not isinstance(meta, dict):
        raise TypeError(f"cache meta must be a dict, got {type(meta).__name__}")
    reserved = RESERVED_META_KEYS.intersection(meta)
    if reserved:
        raise ValueError(f"cache meta must not set {sorted(reserved)}: the cache fills them in")
    return json.loads(json.dumps(meta))  # a pure-JSON deep copy; TypeError if not serialisable


def _is_disk_full(exc: BaseException | None) -> bool:
    """ENOSPC/EDQUOT anywhere in the exception's cause/context chain."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL_ERRNOS:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
    if not isinstance(name, str) or not name or name.startswith("/") or "\\" in name:
        return None
    parts = PurePosixPath(name).parts
    return None if not parts or ".." in parts or "." in parts else parts


def _trust_error(path: Path, st: os.stat_result) -> UntrustedCacheError | None:
    mode, uid = stat.S_IMODE(st.st_mode), os.geteuid()
    if st.st_uid != uid:
        problem = f"owned by uid {st.st_uid}, not by the current uid {uid}"
    elif mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("world", 0o002)) if mode & bit)
        problem = f"{who}-writable (mode {mode:#o})"
    else:
        return None
    return UntrustedCacheError(
        f"refusing to use fa4gen kernel cache path {path}: it is {problem}. Cached kernels are "
        f"shared objects whose code runs when loaded, so only you may be able to write the cache. "
        f"Fix: `chmod go-w {path}` (and `chown {uid} {path}` if it is not yours), or set "
        f"{TRUSTED_ENV}=1 (or pass trusted=True) for a shared read-only cache you trust.")


def _doc_problem(doc: Any, key: str) -> str | None:
    """What is wrong with a parsed meta.json of entry `key`, or None."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_VERSION:
        return f"{META_NAME} is not in cache format {FORMAT_VERSION}"
    if doc.get("key") != key:
        return f"{META_NAME} names key {doc.get('key')!r}, not the entry's key"
    meta = doc.get("meta")
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{META_NAME} lists no files"
    for name, digest in files.items():
        parts = _safe_parts(name)
        if parts is None or "/".join(parts) != name or name == META_NAME:
            return f"{META_NAME} lists an unsafe file name {name!r}"
        if not isinstance(digest, str) or not _KEY_RE.fullmatch(digest):
            return f"{META_NAME} has a malformed sha256 for {name!r}"
    if not isinstance(meta.get("size"), int) or not isinstance(meta.get("created"), (int, float)):
        return f"{META_NAME} lacks size or created"
    return None


def _collect(top: Path) -> tuple[dict[str, str], int]:
    """sha256 of every file a build wrote under `top`; drops group/world write and exec bits."""
    files: dict[str, str] = {}
    size = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            st, rel = os.lstat(path), path.relative_to(top).as_posix()
            if stat.S_ISDIR(st.st_mode):
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o755)
                continue
            if not stat.S_ISREG(st.st_mode):
                raise CacheError(f"build wrote {rel!r}, which is not a regular file "
                                 f"(symlinks and special files cannot be cached)")
            if rel == META_NAME or _safe_parts(rel) is None:
                raise CacheError(f"build wrote {rel!r}: that name is reserved or unsafe")
            os.chmod(path, stat.S_IMODE(st.st_mode) & 0o644)
            files[rel], size = _sha256_file(path), size + st.st_size
    if not files:
        raise CacheError(f"build wrote no files into {top}")
    return dict(sorted(files.items())), size


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, current = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (held.st_dev, held.st_ino) == (current.st_dev, current.st_ino)


class KernelCache:
    """Directory of compiled kernels keyed by make_key(); safe for concurrent processes."""

    def __init__(self, root: str | Path | None = None, *, size_limit: int | None = None,
                 trusted: bool | None = None):
        self.root = Path(root if root is not None else default_cache_root()).expanduser().absolute()
        if size_limit is None:
            env = os.environ.get(SIZE_LIMIT_ENV, "").strip()
            size_limit = parse_size(env, SIZE_LIMIT_ENV) if env else DEFAULT_SIZE_LIMIT
        self.size_limit = parse_size(size_limit, "size_limit")
        if trusted is None:
            trusted = os.environ.get(TRUSTED_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        self.trusted = bool(trusted)
        self._entries, self._locks = self.root / "entries", self.root / "locks"
        self._tmp, self._index_dir = self.root / "tmp", self.root / "index"
        self._index: Any = None
        self._index_unusable = False
        try:
            _mkdirs(self.root, 0o700)
            if not os.path.isdir(self.root):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        except OSError as exc:
            raise CacheError(f"cannot use {self.root} as the fa4gen cache directory ({exc}); set "
                             f"{DEFAULT_ENV} to a directory you can write") from exc
        for path in (self.root, self._entries, self._index_dir):
            with contextlib.suppress(FileNotFoundError):
                self._check_path(path, os.stat(path))

    def __enter__(self) -> KernelCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the index database (it reopens on next use)."""
        if self._index is not None:
            with contextlib.suppress(Exception):
                self._index.close()
            self._index = None

    def lookup(self, key: str) -> CacheEntry | None:
        """The verified entry for `key`, or None if missing or broken (broken ones are removed)."""
        return self._lookup(_check_key(key), locked=False)

    def get_or_build(self, key: str, meta: dict, build: Callable[[Path], None], *,
                     no_compile: bool = False, miss_message: str = "") -> tuple[CacheEntry, bool]:
        """(entry, built_now): the cached entry, calling build(tmpdir) once across processes."""
        meta = _check_meta(meta)
        entry = self.lookup(key)
        if entry is not None:
            return entry, False
        if no_compile:
            raise CacheMiss(miss_message or f"kernel {key} is not in the fa4gen cache at "
                            f"{self.root} and compilation is disabled (no_compile=True)")
        self._ensure_dirs()
        with self._locked(key):
            entry = self._lookup(key, locked=True)  # another process may have built it meanwhile
            if entry is not None:
                return entry, False
            self._sweep_tmp(key)
            entry = self._build(key, meta, build)
            self._touch(entry)
        self._evict(keep={key})
        return entry, True

    def entries(self) -> list[CacheEntry]:
        """Every entry whose meta.json parses (not re-hashed), most recently used first."""
        result = []
        for key in self._keys():
            meta, _ = self._read_meta(self._entries / key, key)
            if meta is None:
                continue
            recorded = self._index_call(lambda index: index.get(key))
            meta["last_use"] = meta["created"]
            with contextlib.suppress(TypeError, ValueError, KeyError):
                meta["last_use"] = float(json.loads(recorded)["last_use"])
            with contextlib.suppress(OSError):  # hits mark use on the directory (see _mark_used)
                meta["last_use"] = max(meta["last_use"], os.stat(self._entries / key).st_mtime)
            result.append(CacheEntry(key, self._entries / key, meta))
        return sorted(result, key=lambda e: e.meta["last_use"], reverse=True)

    def verify(self) -> list[tuple[str, str | None]]:
        """(key, problem or None) for every entry directory, re-hashing every file."""
        report = []
        for key in self._keys():
            try:
                entry, problem = self._load(key, force=True)
            except UntrustedCacheError as exc:
                entry, problem = None, str(exc)
            if entry is not None or problem is not None:
                report.append((key, problem))
        return report

    def clear(self, *, predicate: Callable[[CacheEntry], bool] | None = None) -> int:
        """Remove every entry (broken ones included), or those matching `predicate`."""
        if predicate is None:
            keys = self._keys()
        else:
            keys = [entry.key for entry in self.entries() if predicate(entry)]
        self._ensure_dirs()
        removed = 0
        for key in keys:
            with self._locked(key):
                removed += os.path.lexists(self._entries / key) and self._remove_locked(key)
        return removed

    def drop_files(self, names: Collection[str]) -> int:
        """Remove the files ``names`` from every entry that lists them, and from its meta.json
        (files and size): e.g. the PTX kept for inspection, to ship a smaller cache. An entry
        keeps a file that is its last one; broken entries are left alone. Returns how many
        entries changed. Like ``clear``, meant for a cache no process is loading from."""
        self._ensure_dirs()
        changed = 0
        for entry in self.entries():
            with self._locked(entry.key):
                changed += self._drop_locked(entry.key, set(names))
        return changed

    def _drop_locked(self, key: str, names: set[str]) -> bool:
        entry, _ = self._load(key, force=True)
        if entry is None:
            return False
        files = entry.meta["files"]
        gone = names.intersection(files)
        if not gone or gone == set(files):
            return False
        kept = {name: digest for name, digest in files.items() if name not in gone}
        meta = {**entry.meta, "files": kept,
                "size": sum(os.lstat(entry.path / name).st_size for name in kept)}
        # the new meta.json replaces the old one atomically before the files go: an
        # interruption leaves at worst unlisted files, which lookups ignore
        used = os.stat(entry.path)  # the directory's times record its last use (_mark_used)
        staging = self._new_tmpdir(key)
        try:
            _write_json(staging / META_NAME, {"format": FORMAT_VERSION, "key": key, "meta": meta})
            os.replace(staging / META_NAME, entry.path / META_NAME)
        finally:
            _rmtree(staging)
        for name in gone:
            os.unlink(entry.path / name)
        os.utime(entry.path, ns=(used.st_atime_ns, used.st_mtime_ns))
        return True

    def export(self, archive: Path) -> int:
        """Write every verified entry into the tar.gz `archive`; returns how many."""
        import tarfile

        archive = Path(archive)
        partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
        count = 0
        try:
            with tarfile.open(partial, "w:gz") as tar:
                for key in self._keys():
                    entry, problem = self._load(key)
                    if problem is not None:
                        warnings.warn(f"fa4gen cache: not exporting broken entry {key}: "
                                      f"{problem}", CacheCorruptionWarning, stacklevel=2)
                    if entry is not None:
                        for name in [*entry.meta["files"], META_NAME]:
                            _add_to_tar(tar, entry.path / name, f"{key}/{name}")
                        count += 1
            os.replace(partial, archive)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(partial)
            if _is_disk_full(exc):
                raise self._full_error(f"archive {archive}", archive.parent, exc) from exc
            raise
        return count

    def import_(self, archive: Path) -> int:
        """Add the verified entries of a tar.gz made by export(); returns how many were added."""
        self._ensure_dirs()
        work = None
        try:
            work = self._new_tmpdir("import")
            keys = _extract(Path(archive), work)
            imported = [key for key in sorted(keys) if self._adopt(key, work / key)]
        except BaseException as exc:
            if _is_disk_full(exc):
                raise self._full_error(f"entries from {archive}", self._tmp, exc) from exc
            raise
        finally:
            if work is not None:
                _rmtree(work)
        if imported:
            self._evict(keep=set(imported))
        return len(imported)

    # -------------------------------------------------------------------- verification
    def _check_path(self, path: Path, st: os.stat_result) -> None:
        error = None if self.trusted else _trust_error(path, st)
        if error is not None:
            raise error

    def _read_meta(self, directory: Path, key: str) -> tuple[dict | None, str | None]:
        """(meta, None), or (None, problem), or (None, None) when there is no such entry."""
        try:
            with open(directory / META_NAME, "rb") as f:
                self._check_path(directory / META_NAME, os.fstat(f.fileno()))
                raw = f.read()
        except FileNotFoundError:
            return None, (f"{META_NAME} is missing" if os.path.lexists(directory) else None)
        except OSError as exc:
            return None, f"cannot read {META_NAME}: {exc.strerror or exc}"
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            return None, f"{META_NAME} does not parse ({exc})"
        problem = _doc_problem(doc, key)
        return (None, problem) if problem else (doc["meta"], None)

    def _verify_files(self, directory: Path, files: dict[str, str], force: bool) -> str | None:
        """What is wrong with the listed files, or None; hashes are memoised by file stats."""
        self._check_path(directory, os.stat(directory))
        signature: list[Any] = [str(directory)]
        for name, digest in sorted(files.items()):
            try:
                st = os.lstat(directory / name)
            except OSError as exc:
                return f"file {name!r} is missing ({exc.strerror})"
            if not stat.S_ISREG(st.st_mode):
                return f"{name!r} is not a regular file"
            self._check_path(directory / name, st)
            signature.append((name, digest, st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))
        memo_key = tuple(signature)
        if not force and memo_key in _VERIFIED:
            return None
        started = time.time_ns()
        for name, digest in sorted(files.items()):
            try:
                actual = _sha256_file(directory / name)
            except OSError as exc:
                return f"cannot read {name!r} ({exc.strerror})"
            if actual != digest:
                return f"sha256 of {name!r} is {actual[:16]}..., expected {digest[:16]}..."
        # Memoise only files older than the clock granularity: a write within the same tick as
        # the original keeps (size, mtime) unchanged and would otherwise go unnoticed.
        if all(item[3] < started - _RACY_NS for item in signature[1:]):
            if len(_VERIFIED) >= _VERIFIED_MAX:
                _VERIFIED.clear()
            _VERIFIED[memo_key] = None
        return None

    def _load(self, key: str, *, force: bool = False) -> tuple[CacheEntry | None, str | None]:
        directory = self._entries / key
        meta, problem = self._read_meta(directory, key)
        if meta is None:
            return None, problem
        try:
            problem = self._verify_files(directory, meta["files"], force)
        except FileNotFoundError:
            return None, None  # removed while we looked
        return (None, problem) if problem else (CacheEntry(key, directory, meta), None)

    def _lookup(self, key: str, *, locked: bool) -> CacheEntry | None:
        entry, problem = self._load(key)
        if problem is not None:
            self._discard_broken(key, problem, locked=locked)
        elif entry is not None:
            self._mark_used(entry)
        return entry

    def _discard_broken(self, key: str, problem: str, *, locked: bool) -> None:
        removed = False
        if locked:
            removed = self._discard(self._entries / key)
        else:  # only if nobody is building this key right now, and it is still broken
            with contextlib.suppress(OSError), self._locked(key, blocking=False) as got:
                if got and self._load(key)[1] is not None:
                    removed = self._discard(self._entries / key)
        action = "removed it" if removed else "treating it as missing"
        warnings.warn(f"fa4gen cache entry {key} in {self._entries} is broken: {problem}; "
                      f"{action}", CacheCorruptionWarning, stacklevel=4)
        log.warning("fa4gen cache entry %s is broken: %s; %s", key, problem, action)

    # -------------------------------------------------------------------- writing
    def _build(self, key: str, meta: dict, build: Callable[[Path], None]) -> CacheEntry:
        tmp = None
        try:
            tmp = self._new_tmpdir(key)
            build(tmp)
            files, size = _collect(tmp)
            full = {**meta, "files": files, "created": time.time(), "size": size}
            _write_json(tmp / META_NAME, {"format": FORMAT_VERSION, "key": key, "meta": full})
            dest = self._entries / key
            self._discard(dest)  # a broken leftover: we hold the lock and it did not verify
            os.rename(tmp, dest)
        except BaseException as exc:
            if tmp is not None:
                _rmtree(tmp)
            if _is_disk_full(exc):
                raise self._full_error(f"cache entry {key}", self._tmp, exc) from exc
            raise
        return CacheEntry(key, dest, full)

    def _adopt(self, key: str, staged: Path) -> bool:
        """Move an extracted entry into entries/ if it verifies and is not already there."""
        meta, problem = self._read_meta(staged, key)
        if meta is not None:
            problem = _unlisted(staged, meta["files"]) or self._verify_files(
                staged, meta["files"], force=True)
        if problem is not None or meta is None:
            warnings.warn(f"fa4gen cache: not importing entry {key}: {problem}",
                          CacheCorruptionWarning, stacklevel=3)
            return False
        with self._locked(key):
            if self._load(key)[0] is not None:
                return False
            self._discard(self._entries / key)
            os.rename(staged, self._entries / key)
            self._touch(CacheEntry(key, self._entries / key, meta))
        return True

    def _ensure_dirs(self) -> None:
        try:
            for directory in (self._entries, self._locks, self._tmp):
                _mkdirs(directory, 0o755)
        except OSError as exc:
            if _is_disk_full(exc):
                raise self._full_error("cache directories", self.root, exc) from exc
            raise CacheError(f"cannot create the cache directories under {self.root} ({exc}); "
                             f"a read-only cache can only be used with no_compile=True") from exc

    def _new_tmpdir(self, prefix: str) -> Path:
        while True:
            path = self._tmp / f"{prefix}.{os.getpid()}.{secrets.token_hex(4)}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
                return path

    def _sweep_tmp(self, key: str) -> None:
        """Remove staging left by dead processes. The caller holds the lock of `key`, so a build
        directory of that key belongs to a builder that died holding it."""
        now = time.time()
        with contextlib.suppress(OSError), os.scandir(self._tmp) as children:
            for child in children:
                stale = child.name.startswith((f"{key}.", "trash-"))
                if child.name.startswith("import."):
                    stale = now - child.stat(follow_symlinks=False).st_mtime > _STALE_IMPORT_S
                if stale:
                    _rmtree(Path(child.path))

    def _full_error(self, what: str, where: Path, exc: BaseException) -> CacheFullError:
        try:
            free = f"{shutil.disk_usage(where).free / 2**20:.1f} MiB"
        except OSError:
            free = "an unknown amount of space"
        return CacheFullError(
            f"disk full while writing {what} in {where} ({exc}); {free} is free on that "
            f"filesystem and nothing was kept. Free some space (`fa4gen cache clear`), lower "
            f"{SIZE_LIMIT_ENV}, or set {DEFAULT_ENV} to a directory on a larger filesystem.")

    # -------------------------------------------------------------------- removal, eviction
    def _keys(self) -> list[str]:
        try:
            return sorted(name for name in os.listdir(self._entries) if _KEY_RE.fullmatch(name))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _discard(self, path: Path) -> bool:
        """Remove an entry directory: renamed away first (atomic for readers), then deleted."""
        if not os.path.lexists(path):
            return True
        trash = self._tmp / f"trash-{secrets.token_hex(8)}"
        try:
            os.rename(path, trash)
        except OSError:
            trash = path
        _rmtree(trash)
        return not os.path.lexists(path)

    def _remove_locked(self, key: str) -> bool:
        """Remove the entry, index record and lock file of `key`; the caller holds its lock."""
        removed = self._discard(self._entries / key)
        self._index_call(lambda index: index.delete(key))
        with contextlib.suppress(OSError):
            os.unlink(self._locks / f"{key}.lock")  # waiters notice and re-open (_locked)
        return removed

    def _evict(self, keep: set[str]) -> None:
        """Remove least-recently-used entries (never `keep`, never locked ones) to fit the limit."""
        listed = self.entries()
        total = sum(entry.meta["size"] for entry in listed)
        for entry in reversed(listed):
            if total <= self.size_limit:
                break
            if entry.key in keep:
                continue
            with self._locked(entry.key, blocking=False) as got:
                if got and self._remove_locked(entry.key):
                    total -= entry.meta["size"]
                    log.info("fa4gen cache: evicted %s (%d bytes) to stay under %d bytes",
                             entry.key, entry.meta["size"], self.size_limit)

    # -------------------------------------------------------------------- locks and index
    @contextlib.contextmanager
    def _locked(self, key: str, *, blocking: bool = True) -> Iterator[bool]:
        """Hold the flock of `key`; yields False when it is taken and blocking is False. The OS
        drops the lock when its holder dies, so a killed build never leaves a stale lock."""
        path = self._locks / f"{key}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
                    got: bool | None = True if _same_file(fd, path) else None
                except BlockingIOError:
                    got = False
                if got is not None:  # None: the file was unlinked with its entry; open anew
                    yield got
                    return
            finally:
                os.close(fd)

    @staticmethod
    def _mark_used(entry: CacheEntry) -> None:
        """A hit records its use as the entry directory's mtime: one syscall, no index write,
        so loading a cached kernel stays in the millisecond range (entries() merges both)."""
        now = time.time()
        entry.meta["last_use"] = now
        with contextlib.suppress(OSError):
            os.utime(entry.path, (now, now))

    def _touch(self, entry: CacheEntry) -> None:
        entry.meta["last_use"] = time.time()
        record = json.dumps(entry.meta)
        self._index_call(lambda index: index.set(entry.key, record))

    def _index_call(self, op: Callable[[Any], Any]) -> Any:
        """op(index), or None when the index is unusable: it is advisory, never fatal."""
        for attempt in (0, 1):
            index = self._open_index()
            if index is None:
                return None
            try:
                return op(index)
            except Exception as exc:  # sqlite3.Error, OSError, diskcache.Timeout, bad records
                self.close()  # e.g. the index directory was deleted under us: reopen once
                if attempt:
                    log.warning("fa4gen cache index %s failed (%s); continuing without it",
                                self._index_dir, exc)
        return None

    def _open_index(self) -> Any:
        if self._index is None and not self._index_unusable:
            import diskcache

            for attempt in (0, 1):
                try:
                    self._index = diskcache.Cache(str(self._index_dir), timeout=10,
                                                  eviction_policy="none")
                    break
                except Exception as exc:  # sqlite3.Error, OSError, diskcache.Timeout
                    if attempt == 0 and type(exc) is sqlite3.DatabaseError:  # not a database
                        log.warning("fa4gen cache index %s is corrupt; recreating it",
                                    self._index_dir)
                        _rmtree(self._index_dir)
                        continue
                    log.info("fa4gen cache index %s unusable (%s); last-use tracking is off",
                             self._index_dir, exc)
                    self._index_unusable = True
        return self._index


def _unlisted(directory: Path, files: dict[str, str]) -> str | None:
    found = {Path(dirpath, name).relative_to(directory).as_posix()
             for dirpath, _, names in os.walk(directory) for name in names}
    extra = sorted(found - set(files) - {META_NAME})
    return f"it holds files its {META_NAME} does not list: {extra}" if extra else None


def _add_to_tar(tar: Any, path: Path, arcname: str) -> None:
    import tarfile

    with open(path, "rb") as f:
        info = tarfile.TarInfo(arcname)  # owner 0, no absolute paths, no host details
        info.size, info.mtime, info.mode = os.fstat(f.fileno()).st_size, int(time.time()), 0o644
        tar.addfile(info, f)


def _member_parts(member: Any, archive: Path) -> tuple[str, ...]:
    """Path components of a tar member; refuses anything that could escape or is not a file."""
    parts = _safe_parts(member.name)
    if parts is None:
        raise CacheError(f"refusing to import {archive}: member {member.name!r} is an absolute "
                         f"path or leaves the archive directory ('..')")
    if not (member.isfile() or member.isdir()):
        kind = "symlink" if member.issym() else "hard link" if member.islnk() else "special file"
        raise CacheError(f"refusing to import {archive}: member {member.name!r} is a {kind}; "
                         f"only regular files and directories are allowed")
    if not _KEY_RE.fullmatch(parts[0]) or (member.isfile() and len(parts) < 2):
        raise CacheError(f"refusing to import {archive}: member {member.name!r} is not inside "
                         f"a <key>/ directory, so this is not an fa4gen cache archive")
    return parts


def _extract(archive: Path, work: Path) -> set[str]:
    """Unpack `archive` under `work`, writing every file ourselves; returns the keys it holds."""
    import gzip
    import tarfile
    import zlib

    keys: set[str] = set()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                parts = _member_parts(member, archive)
                keys.add(parts[0])
                target = work.joinpath(*parts)
                _mkdirs(target if member.isdir() else target.parent, 0o755)
                if member.isfile():
                    with tar.extractfile(member) as src, open(os.open(target, flags, 0o644),
                                                              "wb") as out:
                        shutil.copyfileobj(src, out)
    except FileExistsError as exc:
        raise CacheError(f"refusing to import {archive}: duplicate member {exc.filename}") from exc
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise CacheError(f"cannot read cache archive {archive}: {exc}") from exc
    return keys
