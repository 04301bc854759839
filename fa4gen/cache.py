"""On-disk cache of compiled kernel artifacts, shared safely between processes and machines.

Layout under the root: ``entries/<key>/`` holds one kernel's files plus ``meta.json`` (written
last: the commit marker); ``index/`` is a diskcache.Cache of key -> meta + last use (advisory, may
be deleted at will); ``locks/<key>.lock`` serialises builds of a key with fcntl.flock; ``tmp/`` is
staging on the same filesystem. An entry exists iff its meta.json parses, names the key, and every
file it lists hashes to the recorded sha256 (a fresh build included). Entries appear only by atomic
rename of a complete directory, so readers see nothing or a whole entry; anything else counts as
missing. Readers hold a shared flock on an entry's meta.json from lookup until it is loaded
(``KernelCache.pinned``); eviction and ``clear`` take it exclusively without waiting and skip
entries in use, so a found entry is never deleted before it loads.

Trust: kernels are shared objects, so every directory and file the loader reads must be writable
only by this process's user or root (a root-owned read-only cache is fine for any user).
Archives (export / import_) live in fa4gen.cache_archive.

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
import threading
import time
import warnings
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator

from fa4gen.cache_base import (  # noqa: F401 (re-exported: the cache's public names)
    _DISK_FULL_ERRNOS,
    _KEY_RE,
    FORMAT_VERSION,
    MAX_META_BYTES,
    META_NAME,
    CacheCorruptionWarning,
    CacheEntry,
    CacheError,
    CacheFullError,
    CacheMiss,
    CacheSizeWarning,
    CacheWarning,
    ReadOnlyCacheError,
    UntrustedCacheError,
    _check_key,
    _is_disk_full,
    _mkdirs,
    _rmtree,
    _safe_parts,
    _write_json,
)

if TYPE_CHECKING:
    from fa4gen.cache_archive import ArchiveLimits

DEFAULT_ENV = "FA4GEN_CACHE_DIR"
SIZE_LIMIT_ENV = "FA4GEN_CACHE_SIZE_LIMIT"
TRUSTED_ENV = "FA4GEN_CACHE_TRUSTED"
DEFAULT_SIZE_LIMIT = 10 * 1024**3
RESERVED_META_KEYS = frozenset({"files", "created", "size", "last_use"})
# Entries used this recently are never evicted: a process that found or built one may be about to
# load it without pinning (an older fa4gen; a `fa4gen warm` worker's kernels until the run ends).
EVICTION_GRACE_S = 3600.0

_SIZE_RE = re.compile(r"(\d+(?:\.\d*)?)\s*([kmgtp]?)(?:i?b)?", re.IGNORECASE)
_RACY_NS = 2_000_000_000  # files modified more recently than this are re-hashed on every lookup
_VERIFIED: dict[tuple, None] = {}  # per-process memo of verified (path, file stats, digests)
_VERIFIED_MAX = 4096
_STALE_IMPORT_S = 24 * 3600
_WARNED_OVER_LIMIT: set[str] = set()  # roots whose size-limit warning this process printed

log = logging.getLogger(__name__)


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
        raise ValueError(
            f"{source}: cannot use {value!r}; expected a byte count such as "
            f"1073741824 or a number with a K/M/G/T suffix such as 500M or 10G"
        )
    return value


def _check_meta(meta: dict) -> dict:
    if not isinstance(meta, dict):
        raise TypeError(f"cache meta must be a dict, got {type(meta).__name__}")
    reserved = RESERVED_META_KEYS.intersection(meta)
    if reserved:
        raise ValueError(f"cache meta must not set {sorted(reserved)}: the cache fills them in")
    return json.loads(json.dumps(meta))  # a pure-JSON deep copy; TypeError if not serialisable


def _sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _trust_error(path: Path, st: os.stat_result) -> UntrustedCacheError | None:
    """Why someone other than this process's user could change `path`, or None. Root may own
    it (root can change any file anyway); group or world write, or another owner, is refused."""
    mode, uid, owner = stat.S_IMODE(st.st_mode), os.geteuid(), st.st_uid
    if mode & 0o022:
        who = " and ".join(w for w, bit in (("group", 0o020), ("world", 0o002)) if mode & bit)
        problem = f"{who}-writable (mode {mode:#o})"
        fix = f"`chmod go-w {path}`" + ("" if owner in (uid, 0) else f" (as its owner, uid {owner})")
    elif owner not in (uid, 0):
        problem = f"owned by uid {owner}, another user, who could change the kernels in it"
        fix = (
            f"`chown -R {uid}` or `chown -R root` it (a cache that only you or root can write "
            f"is accepted, read-only included)"
        )
    else:
        return None
    return UntrustedCacheError(
        f"refusing to use fa4gen kernel cache path {path}: it is {problem}. Cached kernels are "
        f"shared objects whose code runs when loaded, so no other user may be able to write the "
        f"cache. Fix: {fix}, or set {TRUSTED_ENV}=1 (or pass trusted=True) if you trust "
        f"whoever can write it."
    )


def _can_access(path: Path, mode: int) -> bool:
    """os.access for the effective uid (the one the kernel checks on open), where supported."""
    flags = {"effective_ids": True} if os.access in os.supports_effective_ids else {}
    return os.access(path, mode, **flags)


def _size_text(size: int) -> str:
    return f"{size / 2**20:.2f} MiB" if size >= 2**20 else f"{size} bytes"


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
                raise CacheError(
                    f"build wrote {rel!r}, which is not a regular file (symlinks and special files cannot be cached)"
                )
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
    """Directory of compiled kernels keyed by make_key(); safe for concurrent processes.

    A cache this process cannot write (e.g. one owned by root and baked into an image) serves
    hits as usual; a miss raises ReadOnlyCacheError, one line saying so, instead of compiling
    somewhere the next process would not look (warm the cache where it is built, or point
    FA4GEN_CACHE_DIR at a writable directory), and clear, drop_files and import_ raise it too.
    """

    def __init__(self, root: str | Path | None = None, *, size_limit: int | None = None, trusted: bool | None = None):
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
        self._local = threading.local()  # .pins: key -> fd, while this thread is in pinned()
        try:
            _mkdirs(self.root, 0o700)
            if not os.path.isdir(self.root):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory")
        except OSError as exc:
            raise CacheError(
                f"cannot use {self.root} as the fa4gen cache directory ({exc}); set "
                f"{DEFAULT_ENV} to a directory you can write"
            ) from exc
        self._check_dirs()

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

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """Entries that lookup / get_or_build return to this thread inside the block stay pinned
        until it ends: no process evicts or clears them. Hold it from lookup until the artifact
        is loaded (api.build and api.compile do); a nested block joins the outer one."""
        if getattr(self._local, "pins", None) is not None:
            yield
            return
        self._local.pins = pins = {}
        try:
            yield
        finally:
            self._local.pins = None
            for fd in pins.values():
                os.close(fd)

    def lookup(self, key: str) -> CacheEntry | None:
        """The verified entry for `key`, or None if missing or broken (broken ones are removed,
        with one CacheCorruptionWarning). Inside pinned() the entry stays pinned."""
        return self._lookup(_check_key(key), locked=False)[0]

    def get_or_build(
        self, key: str, meta: dict, build: Callable[[Path], None], *, no_compile: bool = False, miss_message: str = ""
    ) -> tuple[CacheEntry, bool]:
        """(entry, built_now): the cached entry, calling build(tmpdir) once across processes. A
        fresh build is re-hashed where it lies before it is returned, like a hit; inside pinned()
        the entry stays pinned. A miss raises CacheMiss with `no_compile`, ReadOnlyCacheError in
        a cache this process cannot write."""
        meta = _check_meta(meta)
        entry, problem = self._lookup(_check_key(key), locked=False)
        if entry is not None:
            return entry, False
        if no_compile:
            raise CacheMiss(
                miss_message
                or f"kernel {key} is not in the fa4gen cache at "
                f"{self.root} and compilation is disabled (no_compile=True)"
            )
        if reason := self._read_only_reason():
            raise ReadOnlyCacheError(
                f"kernel {key} is not in the fa4gen cache at {self.root}, which is {reason}: "
                f"warm the cache where it is built (`fa4gen warm`), or set {DEFAULT_ENV} to a "
                f"directory you can write to compile here"
            )
        self._ensure_dirs()
        with self._locked(key):
            # another process may have built it meanwhile; a broken entry was reported above
            entry, _ = self._lookup(key, locked=True, quiet=problem is not None)
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
            recorded = self._index_call(lambda index, key=key: index.get(key))
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
        """Remove every entry (broken ones included), or those matching `predicate`, except
        those a process has pinned (it is loading them); returns how many were removed."""
        self._require_writable("clear")
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
        keeps a file that is its last one; broken and pinned entries are left alone. Returns how
        many entries changed. Like ``clear``, meant for a cache no process is loading from."""
        from fa4gen.cache_archive import drop_files

        return drop_files(self, set(names))

    def export(self, archive: Path) -> int:
        """Write every verified entry into the tar.gz `archive`; returns how many."""
        from fa4gen.cache_archive import export_entries

        return export_entries(self, Path(archive))

    def import_(self, archive: Path, *, sha256: str | None = None, limits: ArchiveLimits | None = None) -> int:
        """Add the entries of a tar.gz made by export() that verify; returns how many were added
        (entries already present are kept).

        An archive is code: its kernel.so files are loaded and run. The sha256 of every file in
        an entry's meta.json catches corruption, not malice (whoever made the archive made those
        hashes too), so import only archives from a source you trust. ``sha256`` pins the
        archive's own digest: it is checked over the whole file before anything is extracted.
        Extraction streams under fa4gen.cache_archive.ArchiveLimits (bytes per file and in all,
        members, meta.json and PAX header sizes; ``limits`` overrides them) and refuses links,
        devices, absolute paths and '..': a refusal is a one-line CacheError naming the limit,
        and leaves nothing in the cache."""
        from fa4gen.cache_archive import import_entries

        return import_entries(self, Path(archive), sha256, limits)

    # -------------------------------------------------------------------- verification
    def _check_path(self, path: Path, st: os.stat_result) -> None:
        error = None if self.trusted else _trust_error(path, st)
        if error is not None:
            raise error

    def _check_dirs(self) -> None:
        """Refuse a cache whose directories others can write, or this process cannot read."""
        for path in (self.root, self._entries, self._index_dir, self._locks, self._tmp):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            self._check_path(path, st)
            if path in (self.root, self._entries) and not _can_access(path, os.R_OK | os.X_OK):
                raise CacheError(
                    f"cannot read the fa4gen cache directory {path} (mode "
                    f"{stat.S_IMODE(st.st_mode):#o}, owner uid {st.st_uid}): make the cache "
                    f"readable, e.g. `chmod -R a+rX,go-w {self.root}`, or set {DEFAULT_ENV}"
                )

    def _read_only_reason(self) -> str | None:
        """Why this process cannot add or remove entries ("read-only for ..."), or None."""
        for directory in (self._entries, self._locks, self._tmp):
            target = directory if os.path.isdir(directory) else self.root  # made on demand
            if not _can_access(target, os.W_OK | os.X_OK):
                return f"read-only for this process (uid {os.geteuid()} cannot write {target})"
        return None

    def _require_writable(self, action: str) -> None:
        if reason := self._read_only_reason():
            raise ReadOnlyCacheError(f"cannot {action} the fa4gen cache at {self.root}: it is {reason}")

    def _open_meta(self, directory: Path, key: str, *, lock: bool) -> tuple[int | None, dict | None, str | None]:
        """(fd, meta, None) with `fd` open on meta.json (holding a shared flock if `lock`), or
        (None, None, problem), or (None, None, None) when there is no such entry."""
        path = directory / META_NAME
        try:  # O_NONBLOCK: a FIFO in its place must not hang the open
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None, None, (f"{META_NAME} is missing" if os.path.lexists(directory) else None)
        except OSError as exc:
            return None, None, f"cannot open {META_NAME}: {exc.strerror or exc}"
        meta = problem = None
        try:
            if lock:
                with contextlib.suppress(OSError):  # a filesystem without locks: no pins there
                    fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a removal (one rename)
            if not lock or _same_file(fd, path):  # else removed or replaced meanwhile: absent
                meta, problem = self._parse_meta(fd, path, key)
        finally:
            if meta is None:
                os.close(fd)
        return (fd, meta, None) if meta is not None else (None, None, problem)

    def _parse_meta(self, fd: int, path: Path, key: str) -> tuple[dict | None, str | None]:
        st = os.fstat(fd)
        self._check_path(path, st)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{META_NAME} is not a regular file"
        try:
            with open(fd, "rb", closefd=False) as f:
                raw = f.read(MAX_META_BYTES + 1)
        except OSError as exc:
            return None, f"cannot read {META_NAME}: {exc.strerror or exc}"
        if len(raw) > MAX_META_BYTES:
            return None, f"{META_NAME} is over the {MAX_META_BYTES}-byte limit"
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            return None, f"{META_NAME} does not parse ({exc})"
        problem = _doc_problem(doc, key)
        return (None, problem) if problem else (doc["meta"], None)

    def _read_meta(self, directory: Path, key: str) -> tuple[dict | None, str | None]:
        """(meta, None), or (None, problem), or (None, None) when there is no such entry."""
        fd, meta, problem = self._open_meta(directory, key, lock=False)
        if fd is not None:
            os.close(fd)
        return meta, problem

    def _verify_files(self, directory: Path, files: dict[str, str], force: bool) -> str | None:
        """What is wrong with the listed files, or None; hashes are memoised by file stats."""
        self._check_path(directory, os.stat(directory))
        signature: list[Any] = [str(directory)]
        parents: set[PurePosixPath] = set()
        for name, digest in sorted(files.items()):
            try:
                for parent in list(PurePosixPath(name).parents)[:-1]:  # "sub" of "sub/plan.json"
                    if parent not in parents:
                        parents.add(parent)
                        st = os.lstat(directory / parent)
                        if not stat.S_ISDIR(st.st_mode):
                            return f"{str(parent)!r} is not a directory"
                        self._check_path(directory / parent, st)
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

    def _load(self, key: str, *, force: bool = False, pin: bool = False) -> tuple[CacheEntry | None, str | None]:
        """(entry, None) if `key` verifies, (None, problem) if it is broken, (None, None) if it
        is absent. With `pin`, inside pinned(), the entry keeps its shared flock."""
        directory = self._entries / key
        fd, meta, problem = self._open_meta(directory, key, lock=True)
        if fd is None or meta is None:
            return None, problem
        kept = False
        try:
            try:
                problem = self._verify_files(directory, meta["files"], force)
            except FileNotFoundError:
                return None, None  # removed while we looked
            if problem is not None:
                return None, problem
            kept = pin and self._keep_pin(key, fd)
            return CacheEntry(key, directory, meta), None
        finally:
            if not kept:
                os.close(fd)

    def _keep_pin(self, key: str, fd: int) -> bool:
        """Keep `fd` (a shared flock on key's meta.json) until the pinned() block ends."""
        pins = getattr(self._local, "pins", None)
        if pins is None or key in pins:
            return False
        pins[key] = fd
        return True

    def _lookup(self, key: str, *, locked: bool, quiet: bool = False) -> tuple[CacheEntry | None, str | None]:
        entry, problem = self._load(key, pin=True)
        if problem is not None:
            self._discard_broken(key, problem, locked=locked, quiet=quiet)
        elif entry is not None:
            self._mark_used(entry)
        return entry, problem

    def _discard_broken(self, key: str, problem: str, *, locked: bool, quiet: bool) -> None:
        removed = False
        if locked:
            removed = self._discard(self._entries / key)
        else:  # only if nobody is building this key right now, and it is still broken
            with contextlib.suppress(OSError), self._locked(key, blocking=False) as got:
                if got and self._load(key)[1] is not None:
                    removed = self._discard(self._entries / key)
        if not quiet:  # the one report: the CLI prints warnings, so no log line beside it
            action = "removed it" if removed else "treating it as missing"
            warnings.warn(
                f"fa4gen cache entry {key} in {self._entries} is broken: {problem}; {action}",
                CacheCorruptionWarning,
                stacklevel=4,
            )

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
        # re-hashed where it lies, like a hit: what loads is what entries/ holds, not what
        # _collect saw in tmp/
        entry, problem = self._load(key, force=True, pin=True)
        if entry is None:
            self._discard(dest)
            raise CacheError(
                f"the fresh build of kernel {key} does not verify in "
                f"{self._entries} ({problem or 'it vanished'}); it was removed. "
                f"Is another process writing into {self.root}?"
            )
        return entry

    def _ensure_dirs(self) -> None:
        try:
            for directory in (self._entries, self._locks, self._tmp):
                _mkdirs(directory, 0o755)
        except OSError as exc:
            if _is_disk_full(exc):
                raise self._full_error("cache directories", self.root, exc) from exc
            raise CacheError(
                f"cannot create the cache directories under {self.root} ({exc}); "
                f"a read-only cache can only be used with no_compile=True"
            ) from exc
        self._check_dirs()  # someone may have made them since __init__ looked

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
            f"{SIZE_LIMIT_ENV}, or set {DEFAULT_ENV} to a directory on a larger filesystem."
        )

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
        """Remove the entry, index record and lock file of `key`, unless a process has it pinned
        (then False); the caller holds its build lock."""
        with self._exclusive_pin(key) as free:
            if not free:
                return False
            removed = self._discard(self._entries / key)
        self._index_call(lambda index: index.delete(key))
        with contextlib.suppress(OSError):
            os.unlink(self._locks / f"{key}.lock")  # waiters notice and re-open (_locked)
        return removed

    @contextlib.contextmanager
    def _exclusive_pin(self, key: str) -> Iterator[bool]:
        """Hold key's meta.json exclusively without waiting: False while a reader pins it (an
        entry without a meta.json to open is broken, and nobody can pin it: True)."""
        try:  # read-write: NFS grants an exclusive lock to a writer only
            fd = os.open(self._entries / key / META_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            yield True
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                free = True
            except BlockingIOError:
                free = False
            except OSError:  # a filesystem without locks: nothing can be pinned there
                free = True
            yield free
        finally:
            os.close(fd)

    def _evict(self, keep: set[str]) -> None:
        """Remove least-recently-used entries until the cache fits its size limit. Never `keep`,
        entries pinned by any process or used in the last EVICTION_GRACE_S; when those alone
        exceed the limit, they stay and one CacheSizeWarning per process says so."""
        listed = self.entries()
        total = sum(entry.meta["size"] for entry in listed)
        recent = time.time() - EVICTION_GRACE_S
        for entry in reversed(listed):
            if total <= self.size_limit:
                return
            if entry.key in keep or entry.meta["last_use"] > recent:
                continue
            with self._locked(entry.key, blocking=False) as got:
                if got and self._remove_locked(entry.key):
                    total -= entry.meta["size"]
                    log.info(
                        "fa4gen cache: evicted %s (%d bytes) to stay under %d bytes",
                        entry.key,
                        entry.meta["size"],
                        self.size_limit,
                    )
        if total > self.size_limit and str(self.root) not in _WARNED_OVER_LIMIT:
            _WARNED_OVER_LIMIT.add(str(self.root))
            warnings.warn(
                f"fa4gen cache {self.root} keeps {_size_text(total)} of kernels in use or used in "
                f"the last {EVICTION_GRACE_S / 60:g} minutes, over its size limit of "
                f"{_size_text(self.size_limit)}, and evicted none of them: set {SIZE_LIMIT_ENV}="
                f"{-(-total // 2**20)}M or more",
                CacheSizeWarning,
                stacklevel=3,
            )

    # -------------------------------------------------------------------- locks and index
    @contextlib.contextmanager
    def _locked(self, key: str, *, blocking: bool = True) -> Iterator[bool]:
        """Hold the flock of `key`; yields False when it is taken and blocking is False. The OS
        drops the lock when its holder dies, so a killed build never leaves a stale lock."""
        path = self._locks / f"{key}.lock"
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
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
                    log.warning("fa4gen cache index %s failed (%s); continuing without it", self._index_dir, exc)
        return None

    def _open_index(self) -> Any:
        if self._index is None and not self._index_unusable:
            import diskcache

            for attempt in (0, 1):
                try:
                    self._index = diskcache.Cache(str(self._index_dir), timeout=10, eviction_policy="none")
                    break
                except Exception as exc:  # sqlite3.Error, OSError, diskcache.Timeout
                    if attempt == 0 and type(exc) is sqlite3.DatabaseError:  # not a database
                        log.warning("fa4gen cache index %s is corrupt; recreating it", self._index_dir)
                        _rmtree(self._index_dir)
                        continue
                    log.info("fa4gen cache index %s unusable (%s); last-use tracking is off", self._index_dir, exc)
                    self._index_unusable = True
        return self._index
