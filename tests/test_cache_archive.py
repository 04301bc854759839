"""Tests of cache archives (fa4gen.cache_archive): hostile tar.gz files built here are refused
while they stream, quickly, in bounded memory and disk, with a one-line CacheError naming the
limit, and leave nothing in the cache; a pinned archive digest is checked before extraction."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tarfile
import time
import tracemalloc
from pathlib import Path

import pytest

from fa4gen.cache import CacheError, KernelCache, make_key
from fa4gen.cache_archive import ArchiveLimits

KEY = make_key({"archive": 1})
SMALL = ArchiveLimits(member_bytes=2 * 2**20, total_bytes=8 * 2**20, members=50, meta_bytes=4096, header_bytes=4096)


def fake_build(out: Path) -> None:
    (out / "kernel.so").write_bytes(os.urandom(4096))
    (out / "sub").mkdir()
    (out / ("sub/" + "long-name-" * 12 + ".json")).write_text("{}")  # > 100 chars: a PAX path


def header(name: str, size: int, kind: bytes = tarfile.REGTYPE, **pax: str) -> bytes:
    """A member's header block(s) as tarfile writes them, declaring `size` bytes of data."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.pax_headers = size, kind, pax
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def write_archive(path: Path, parts: list[bytes | tuple[int, int]]) -> Path:
    """A tar.gz of raw `parts`: bytes as given, (n, byte) as n copies of a byte, streamed."""
    with gzip.open(path, "wb", compresslevel=1) as gz:
        for part in parts:
            if isinstance(part, tuple):
                count, value = part
                chunk = bytes([value]) * min(count, 2**20)
                while count > 0:
                    gz.write(chunk[:count])
                    count -= len(chunk)
            else:
                gz.write(part)
    return path


def member(name: str, data: bytes) -> bytes:
    return header(name, len(data)) + data + b"\0" * (-len(data) % 512)


def refused(cache: KernelCache, archive: Path, **options) -> str:
    """The one-line message of the CacheError that importing `archive` raises (fast, bounded
    memory), after checking that nothing was left in the cache."""
    tracemalloc.start()
    started = time.perf_counter()
    try:
        with pytest.raises(CacheError) as info:
            cache.import_(archive, **options)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 10
    assert peak < 16 * 2**20, f"import held {peak} bytes"
    for sub in ("entries", "tmp"):
        path = cache.root / sub
        assert not path.exists() or os.listdir(path) == [], os.listdir(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(("refusing to import", "cannot"))
    return message


@pytest.fixture
def cache(tmp_path) -> KernelCache:
    return KernelCache(tmp_path / "cache")


# --------------------------------------------------------------------------- round trips
def test_round_trip_with_pax_names_and_pinned_digest(tmp_path, cache):
    source = KernelCache(tmp_path / "source")
    entry, _ = source.get_or_build(KEY, {"n": 1}, fake_build)
    archive = tmp_path / "kernels.tar.gz"
    assert source.export(archive) == 1
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert cache.import_(archive, sha256=digest.upper()) == 1
    assert cache.lookup(KEY).meta["files"] == entry.meta["files"]


def test_wrong_digest_is_refused_before_extraction(tmp_path, cache, monkeypatch):
    source = KernelCache(tmp_path / "source")
    source.get_or_build(KEY, {}, fake_build)
    archive = tmp_path / "kernels.tar.gz"
    source.export(archive)
    from fa4gen import cache_archive

    monkeypatch.setattr(cache_archive, "extract", lambda *a: pytest.fail("extracted"))
    message = refused(cache, archive, sha256="0" * 64)
    assert "its sha256 is" in message and "nothing was extracted" in message
    assert "not 64 hex digits" in refused(cache, archive, sha256="abc")


# --------------------------------------------------------------------------- hostile archives
def test_huge_member_is_refused_from_its_header(tmp_path, cache):
    """The issue's 4 MB archive that wrote 3.9 GiB: now nothing is written."""
    archive = write_archive(tmp_path / "bomb.tar.gz", [header(f"{KEY}/kernel.so", 4 * 2**30), (4 * 2**20, 0)])
    message = refused(cache, archive)
    assert "over the limit of 512 MiB per file (MAX_MEMBER_BYTES)" in message


def test_many_members_that_add_up_are_refused_at_the_total(tmp_path, cache):
    parts: list[bytes | tuple[int, int]] = []
    for i in range(10):
        parts += [header(f"{KEY}/part{i}", 1536 * 1024), (1536 * 1024, 0)]
    archive = write_archive(tmp_path / "bomb.tar.gz", parts)
    assert archive.stat().st_size < 200 * 1024
    assert "more than 8 MiB (MAX_TOTAL_BYTES)" in refused(cache, archive, limits=SMALL)


def test_highly_compressed_data_is_refused_by_ratio(tmp_path, cache):
    archive = write_archive(tmp_path / "zeros.tar.gz", [header(f"{KEY}/kernel.so", 256 * 2**20), (256 * 2**20, 0)])
    assert "(MAX_RATIO), like a decompression bomb" in refused(cache, archive)


def test_oversized_pax_header_is_refused_before_it_is_read(tmp_path, cache):
    """The issue's 1 MB archive whose PAX header took 1.1 GB of RAM."""
    archive = write_archive(
        tmp_path / "pax.tar.gz", [header("././@PaxHeader", 2**30, tarfile.XHDTYPE), (2**20, ord("a"))]
    )
    assert "PAX header of 1073741824 bytes is over the limit of 64 KiB" in refused(cache, archive)
    real = write_archive(
        tmp_path / "pax2.tar.gz", [header(f"{KEY}/kernel.so", 1, comment="x" * 100_000), b"x".ljust(512, b"\0")]
    )
    assert "(MAX_HEADER_BYTES)" in refused(cache, real)


def pax_member(**records: str) -> bytes:
    """A PAX extended header ('x') holding `records`, with its padding."""
    body = b""
    for key, value in records.items():
        payload = f" {key}={value}\n".encode()
        length = len(payload) + len(str(len(payload)))
        length += len(str(length)) - len(str(len(payload)))  # the length counts its own digits
        body += str(length).encode() + payload
    return header("pax", len(body), tarfile.XHDTYPE) + body + b"\0" * (-len(body) % 512)


def test_chain_of_extended_headers_counts_as_one(tmp_path, cache):
    chain = [pax_member(comment="y" * 1000) for _ in range(5)]  # 5 KiB before one member
    archive = write_archive(tmp_path / "chain.tar.gz", [*chain, member(f"{KEY}/a", b"a")])
    assert "over the limit of 4 KiB (MAX_HEADER_BYTES)" in refused(cache, archive, limits=SMALL)


def test_huge_meta_json_is_refused(tmp_path, cache):
    archive = write_archive(
        tmp_path / "meta.tar.gz", [header(f"{KEY}/meta.json", 200 * 2**20), (200 * 2**20, ord(" "))]
    )
    assert "for a meta.json (MAX_META_BYTES)" in refused(cache, archive)


def test_too_many_members_are_refused(tmp_path, cache):
    archive = write_archive(tmp_path / "many.tar.gz", [member(f"{KEY}/f{i}", b"") for i in range(60)])
    assert "more than 50 members (MAX_MEMBERS)" in refused(cache, archive, limits=SMALL)


HOSTILE = {
    "symlink": header(f"{KEY}/kernel.so", 0, tarfile.SYMTYPE),
    "hard link": header(f"{KEY}/kernel.so", 0, tarfile.LNKTYPE),
    "character device": header(f"{KEY}/dev", 0, tarfile.CHRTYPE),
    "FIFO": header(f"{KEY}/fifo", 0, tarfile.FIFOTYPE),
    "sparse file": header(f"{KEY}/kernel.so", 0, tarfile.GNUTYPE_SPARSE),
    "absolute path": member("/tmp/evil", b"x"),
    "dotdot": member(f"{KEY}/../../evil", b"x"),
    "pax dotdot": header(f"{KEY}/ok", 1, path="../evil") + b"x".ljust(512, b"\0"),
    "pax sparse": header(f"{KEY}/kernel.so", 0, **{"GNU.sparse.major": "1"}),
    "file as directory": member(f"{KEY}/a", b"x") + member(f"{KEY}/a/b", b"y"),
    "truncated": header(f"{KEY}/kernel.so", 4096) + b"x" * 100,
    "bad checksum": member(f"{KEY}/a", b"x")[:148] + b"0000000\0" + member(f"{KEY}/a", b"x")[156:],
}


@pytest.mark.parametrize("kind", HOSTILE, ids=list(HOSTILE))
def test_hostile_member_is_refused(tmp_path, cache, kind):
    archive = write_archive(tmp_path / "hostile.tar.gz", [HOSTILE[kind]])
    message = refused(cache, archive)
    assert message.startswith("refusing to import")
    assert not (tmp_path / "evil").exists() and not Path("/tmp/evil").exists()


def test_non_gzip_file_is_one_line_error(tmp_path, cache):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not gzip at all")
    assert refused(cache, junk).startswith("cannot read cache archive")


def test_tampered_but_rehashed_entry_imports(tmp_path, cache):
    """What the docs say plainly: meta.json hashes catch corruption, not malice."""
    source = KernelCache(tmp_path / "source")
    source.get_or_build(KEY, {}, lambda out: (out / "kernel.so").write_bytes(b"good"))
    doc = json.loads((source.root / "entries" / KEY / "meta.json").read_text())
    doc["meta"]["files"]["kernel.so"] = hashlib.sha256(b"evil").hexdigest()
    meta = json.dumps(doc).encode()
    archive = write_archive(
        tmp_path / "swapped.tar.gz", [member(f"{KEY}/kernel.so", b"evil"), member(f"{KEY}/meta.json", meta)]
    )
    assert cache.import_(archive) == 1  # hence: only archives from a trusted source
    assert cache.lookup(KEY).file("kernel.so").read_bytes() == b"evil"
