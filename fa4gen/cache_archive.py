"""Shipping a cache: ``KernelCache.export`` writes verified entries into a tar.gz,
``KernelCache.import_`` reads one back, ``KernelCache.drop_files`` trims entries first. Import
goes through the small forward-only tar reader here, which checks every limit from a member's
header before it buffers or writes that member, so a hostile archive costs at most the limits
below in memory, disk and time.

An archive is code: its kernel.so files are loaded and run. The sha256 of each file recorded in
an entry's meta.json catches corruption, not malice (whoever made the archive made the hashes),
so import archives only from a source you trust, and pin the archive's own digest (``sha256=``,
``fa4gen cache import --sha256``) when it travels through hands you do not control.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import os
import re
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from fa4gen.cache_base import (
    _KEY_RE,
    FORMAT_VERSION,
    MAX_META_BYTES,
    META_NAME,
    CacheCorruptionWarning,
    CacheEntry,
    CacheError,
    ReadOnlyCacheError,
    _is_disk_full,
    _mkdirs,
    _rmtree,
    _safe_parts,
    _write_json,
)

if TYPE_CHECKING:
    from fa4gen.cache import KernelCache

MAX_MEMBER_BYTES = 512 * 2**20  # one file of an entry: a kernel.so is a few MiB
MAX_TOTAL_BYTES = 8 * 2**30  # all data read (files go to tmp/ before any entry verifies)
MAX_MEMBERS = 100_000  # headers (extended ones too): ~15k entries of 6 files; bounds the work
MAX_HEADER_BYTES = 64 * 2**10  # one PAX or GNU long-name header, which is held in memory whole
MAX_RATIO = 100  # data per compressed byte past the first 64 MiB: artifacts gzip ~5x, bombs ~1000x
_RATIO_FREE_BYTES = 64 * 2**20

_BLOCK = 512
_CHUNK = 2**20
_FILE_TYPES = {b"0": "file", b"\x00": "file", b"7": "file", b"5": "dir"}
_EXTENDED_TYPES = {b"x", b"g", b"L"}  # PAX local and global headers, GNU long name
_REFUSED_TYPES = {
    b"1": "hard link",
    b"2": "symlink",
    b"3": "character device",
    b"4": "block device",
    b"6": "FIFO",
    b"K": "long link name (of a link)",
    b"S": "sparse file",
}
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class ArchiveLimits:
    """What one import may cost; the defaults are the module constants (tests pass smaller)."""

    member_bytes: int = MAX_MEMBER_BYTES
    total_bytes: int = MAX_TOTAL_BYTES
    members: int = MAX_MEMBERS
    meta_bytes: int = MAX_META_BYTES
    header_bytes: int = MAX_HEADER_BYTES
    ratio: int = MAX_RATIO


def _size(n: int) -> str:
    unit, scale = next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if n >= s), ("bytes", 1))
    return f"{n / scale:g} {unit}"


def _shown(name: str) -> str:
    return repr(name if len(name) <= 120 else name[:100] + "...")


def add_file(tar: Any, path: Path, arcname: str) -> None:
    """Add one file as a plain member: owner 0, mode 0644, no absolute paths or host details."""
    import tarfile

    with open(path, "rb") as f:
        info = tarfile.TarInfo(arcname)
        info.size, info.mtime, info.mode = os.fstat(f.fileno()).st_size, int(time.time()), 0o644
        tar.addfile(info, f)


def check_sha256(raw: IO[bytes], archive: Path, expected: str) -> None:
    """Refuse `archive` (open as `raw`) unless its sha256 is `expected`; rewinds `raw`."""
    wanted = expected.strip().lower() if isinstance(expected, str) else ""
    if not _SHA256_RE.fullmatch(wanted):
        raise CacheError(f"cannot check {archive}: the expected sha256 {str(expected)[:80]!r} is not 64 hex digits")
    if not raw.seekable():  # a pipe: what was hashed could not be read again
        raise CacheError(f"cannot check the sha256 of {archive}: it is not a regular file")
    actual = hashlib.file_digest(raw, "sha256").hexdigest()
    raw.seek(0)
    if actual != wanted:
        raise CacheError(
            f"refusing to import {archive}: its sha256 is {actual}, not the expected {wanted}; nothing was extracted"
        )


class _Counted:
    """The compressed file, counting what gzip reads of it (for the ratio limit)."""

    def __init__(self, raw: IO[bytes]):
        self.raw, self.count = raw, 0

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.count += len(data)
        return data


class _TarStream:
    """The decompressed tar stream, read forward only, with the limits of one import."""

    def __init__(self, raw: IO[bytes], archive: Path, limits: ArchiveLimits):
        self._raw = _Counted(raw)
        self._gz = gzip.GzipFile(fileobj=self._raw, mode="rb")  # type: ignore[arg-type]
        self.archive, self.limits = archive, limits
        self.headers = self.spent = self.inflated = 0

    def refuse(self, why: str) -> CacheError:
        return CacheError(f"refusing to import {self.archive}: {why}")

    def _inflate(self, size: int) -> bytes:
        data = self._gz.read(size)
        self.inflated += len(data)
        if self.inflated > _RATIO_FREE_BYTES and self.inflated > self.limits.ratio * self._raw.count:
            raise self.refuse(
                f"it inflates to over {self.limits.ratio} times its compressed "
                f"size (MAX_RATIO), like a decompression bomb"
            )
        return data

    def read(self, size: int) -> bytes:
        data = self._inflate(size)
        if len(data) != size:
            raise self.refuse("it ends in the middle of a member (truncated)")
        return data

    def skip_padding(self, size: int) -> None:
        self.read(-size % _BLOCK)

    def copy_to(self, fd: int, size: int) -> None:
        while size:
            data = memoryview(self.read(min(size, _CHUNK)))
            size -= len(data)
            while data:
                data = data[os.write(fd, data) :]

    def members(self) -> Iterator[tuple[str, bytes, int]]:
        """(name, type byte, size) of every member; its data comes next in the stream."""
        extended: dict[str, str] = {}  # what PAX / long-name headers say about the next member
        pending = 0
        while True:
            block = self._inflate(_BLOCK)
            if not block.strip(b"\x00"):  # the end-of-archive marker (or no marker at all)
                return
            if len(block) != _BLOCK:
                raise self.refuse("it ends in the middle of a header (truncated)")
            self.headers += 1
            if self.headers > self.limits.members:
                raise self.refuse(
                    f"it has more than {self.limits.members} members (MAX_MEMBERS), more than any fa4gen cache archive"
                )
            name, kind, size = _parse_header(block, self)
            if kind not in _EXTENDED_TYPES:
                name, size = extended.pop("path", name), _pax_size(extended.pop("size", size), self)
                extended, pending = {}, 0
                yield name, kind, size
                continue
            pending += size  # a chain of extended headers counts as one
            if pending > self.limits.header_bytes:
                raise self.refuse(
                    f"a {'PAX' if kind != b'L' else 'long-name'} header of "
                    f"{pending} bytes is over the limit of "
                    f"{_size(self.limits.header_bytes)} (MAX_HEADER_BYTES)"
                )
            self.spend(size)
            data = self.read(size)
            self.skip_padding(size)
            if kind == b"x":
                extended.update(_pax_records(data, self))
            elif kind == b"L":
                extended["path"] = data.split(b"\x00", 1)[0].decode("utf-8", "surrogateescape")

    def spend(self, size: int) -> None:
        """Count `size` bytes against the total (file data and extended headers alike)."""
        if self.spent + size > self.limits.total_bytes:
            raise self.refuse(f"its members add up to more than {_size(self.limits.total_bytes)} (MAX_TOTAL_BYTES)")
        self.spent += size


def _number(field: bytes, stream: _TarStream) -> int:
    """A numeric header field: octal text, or GNU base-256 (first byte 0x80) for large sizes."""
    if field[:1] == b"\x80":
        return int.from_bytes(field[1:], "big")
    text = field.strip(b"\x00 ")
    if not text or not all(48 <= c <= 55 for c in text):
        raise stream.refuse("a member header is malformed: it is not an fa4gen cache archive")
    return int(text, 8)


def _parse_header(block: bytes, stream: _TarStream) -> tuple[str, bytes, int]:
    checksum = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if _number(block[148:156], stream) != checksum:
        raise stream.refuse("a member header has a wrong checksum: it is corrupt or not a tar file")
    name = block[:100].split(b"\x00", 1)[0]
    if block[257:263] == b"ustar\x00" and block[345] != 0:  # POSIX ustar: name = prefix/name
        name = block[345:500].split(b"\x00", 1)[0] + b"/" + name
    return name.decode("utf-8", "surrogateescape"), block[156:157], _number(block[124:136], stream)


def _pax_records(data: bytes, stream: _TarStream) -> dict[str, str]:
    """The "<length> <key>=<value>\\n" records of a PAX header; sparse files are refused."""
    records, pos = {}, 0
    while pos < len(data):
        space = data.find(b" ", pos, pos + 20)
        length = int(data[pos:space]) if space > pos and data[pos:space].isdigit() else 0
        record = data[space + 1 : pos + length]
        if length <= 0 or pos + length > len(data) or not record.endswith(b"\n") or b"=" not in record:
            raise stream.refuse("a PAX header is malformed: it is not an fa4gen cache archive")
        key, value = record[:-1].split(b"=", 1)
        if key.startswith(b"GNU.sparse"):
            raise stream.refuse("it holds a sparse file; only regular files and directories are allowed")
        if key in (b"path", b"size"):  # the only ones that matter here; the rest is dropped
            records[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def _pax_size(value: int | str, stream: _TarStream) -> int:
    if isinstance(value, int):
        return value
    if not value.isdigit():
        raise stream.refuse(f"a PAX header has a malformed size {value[:20]!r}")
    return int(value)


def _checked_parts(name: str, kind: bytes, size: int, stream: _TarStream) -> tuple[str, ...]:
    """Path components of a member, after every check that needs only its header."""
    limits = stream.limits
    if kind not in _FILE_TYPES:
        what = _REFUSED_TYPES.get(kind, f"member of tar type {kind!r}")
        raise stream.refuse(f"member {_shown(name)} is a {what}; only regular files and directories are allowed")
    parts = _safe_parts(name.rstrip("/") if _FILE_TYPES[kind] == "dir" else name)
    if parts is None:
        raise stream.refuse(f"member {_shown(name)} is an absolute path or leaves the archive directory ('..')")
    if not _KEY_RE.fullmatch(parts[0]) or (_FILE_TYPES[kind] == "file" and len(parts) < 2):
        raise stream.refuse(
            f"member {_shown(name)} is not inside a <key>/ directory, so this is not an fa4gen cache archive"
        )
    if _FILE_TYPES[kind] == "dir" and size:
        raise stream.refuse(f"directory member {_shown(name)} carries {size} bytes of data")
    if parts[1:] == (META_NAME,) and size > limits.meta_bytes:
        raise stream.refuse(
            f"{_shown(name)} is {size} bytes, over the limit of "
            f"{_size(limits.meta_bytes)} for a {META_NAME} (MAX_META_BYTES)"
        )
    if size > limits.member_bytes:
        raise stream.refuse(
            f"member {_shown(name)} is {size} bytes, over the limit of "
            f"{_size(limits.member_bytes)} per file (MAX_MEMBER_BYTES)"
        )
    stream.spend(size)  # before a byte of it is written
    return parts


def extract(raw: IO[bytes], archive: Path, work: Path, limits: ArchiveLimits | None = None) -> set[str]:
    """Unpack the tar.gz open as `raw` under `work`, writing every file ourselves (no links, no
    modes or owners from the archive); returns the keys it holds."""
    stream = _TarStream(raw, archive, limits or ArchiveLimits())
    keys: set[str] = set()
    try:
        for name, kind, size in stream.members():
            parts = _checked_parts(name, kind, size, stream)
            keys.add(parts[0])
            _write_member(stream, work.joinpath(*parts), name, _FILE_TYPES[kind], size)
    except (gzip.BadGzipFile, zlib.error, EOFError) as exc:
        raise CacheError(f"cannot read cache archive {archive}: {exc}") from exc
    return keys


def _write_member(stream: _TarStream, target: Path, name: str, kind: str, size: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        _mkdirs(target if kind == "dir" else target.parent, 0o755)
        if kind == "dir":
            return
        fd = os.open(target, flags, 0o644)
    except FileExistsError as exc:
        raise stream.refuse(f"duplicate member {_shown(name)}") from exc
    except NotADirectoryError as exc:
        raise stream.refuse(f"member {_shown(name)} lies inside a file of the archive") from exc
    try:
        stream.copy_to(fd, size)
    finally:
        os.close(fd)
    stream.skip_padding(size)


# ----------------------------------------------------------------------------- KernelCache's side
def export_entries(cache: KernelCache, archive: Path) -> int:
    """KernelCache.export: every verified entry into the tar.gz `archive` (replaced atomically)."""
    import tarfile

    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    count = 0
    try:
        with tarfile.open(partial, "w:gz") as tar:
            for key in cache._keys():
                with cache.pinned():  # neither evicted nor cleared while it is read
                    entry, problem = cache._load(key, pin=True)
                    if problem is not None:
                        warnings.warn(
                            f"fa4gen cache: not exporting broken entry {key}: {problem}",
                            CacheCorruptionWarning,
                            stacklevel=3,
                        )
                    if entry is not None:
                        for name in [*entry.meta["files"], META_NAME]:
                            add_file(tar, entry.path / name, f"{key}/{name}")
                        count += 1
        os.replace(partial, archive)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        if _is_disk_full(exc):
            raise cache._full_error(f"archive {archive}", archive.parent, exc) from exc
        raise
    return count


def import_entries(cache: KernelCache, archive: Path, sha256: str | None, limits: ArchiveLimits | None) -> int:
    """KernelCache.import_ (see its docstring): the digest is checked on the same open file
    that is then extracted, so the file cannot be swapped in between."""
    if reason := cache._read_only_reason():
        raise ReadOnlyCacheError(f"cannot import {archive} into the fa4gen cache at {cache.root}: it is {reason}")
    with open(archive, "rb") as raw:
        if sha256 is not None:
            check_sha256(raw, archive, sha256)
        cache._ensure_dirs()
        work = None
        try:
            work = cache._new_tmpdir("import")
            keys = extract(raw, archive, work, limits)
            imported = [key for key in sorted(keys) if _adopt(cache, key, work / key)]
        except BaseException as exc:
            if _is_disk_full(exc):
                raise cache._full_error(f"entries from {archive}", cache._tmp, exc) from exc
            raise
        finally:
            if work is not None:
                _rmtree(work)
    if imported:
        cache._evict(keep=set(imported))
    return len(imported)


def _adopt(cache: KernelCache, key: str, staged: Path) -> bool:
    """Move an extracted entry into entries/ if it verifies and is not already there."""
    meta, problem = cache._read_meta(staged, key)
    if meta is not None:
        problem = _unlisted(staged, meta["files"]) or cache._verify_files(staged, meta["files"], force=True)
    if problem is not None or meta is None:
        warnings.warn(f"fa4gen cache: not importing entry {key}: {problem}", CacheCorruptionWarning, stacklevel=4)
        return False
    with cache._locked(key):
        if cache._load(key)[0] is not None:
            return False
        cache._discard(cache._entries / key)
        os.rename(staged, cache._entries / key)
        cache._touch(CacheEntry(key, cache._entries / key, meta))
    return True


def _unlisted(directory: Path, files: dict[str, str]) -> str | None:
    found = {
        Path(dirpath, name).relative_to(directory).as_posix()
        for dirpath, _, names in os.walk(directory)
        for name in names
    }
    extra = sorted(found - set(files) - {META_NAME})
    return f"it holds files its {META_NAME} does not list: {extra}" if extra else None


def drop_files(cache: KernelCache, names: set[str]) -> int:
    """KernelCache.drop_files (see its docstring)."""
    cache._require_writable("drop files from")
    cache._ensure_dirs()
    changed = 0
    for entry in cache.entries():
        with cache._locked(entry.key):
            changed += _drop_locked(cache, entry.key, names)
    return changed


def _drop_locked(cache: KernelCache, key: str, names: set[str]) -> bool:
    entry, _ = cache._load(key, force=True)
    if entry is None:
        return False
    files = entry.meta["files"]
    gone = names.intersection(files)
    if not gone or gone == set(files):
        return False
    kept = {name: digest for name, digest in files.items() if name not in gone}
    meta = {**entry.meta, "files": kept, "size": sum(os.lstat(entry.path / name).st_size for name in kept)}
    used = os.stat(entry.path)  # the directory's times record its last use (_mark_used)
    with cache._exclusive_pin(key) as free:  # a reader's pin is on the meta.json replaced here
        if not free:
            return False
        # the new meta.json replaces the old one atomically before the files go: an
        # interruption leaves at worst unlisted files, which lookups ignore
        staging = cache._new_tmpdir(key)
        try:
            _write_json(staging / META_NAME, {"format": FORMAT_VERSION, "key": key, "meta": meta})
            os.replace(staging / META_NAME, entry.path / META_NAME)
        finally:
            _rmtree(staging)
    for name in gone:
        os.unlink(entry.path / name)
    os.utime(entry.path, ns=(used.st_atime_ns, used.st_mtime_ns))
    return True
