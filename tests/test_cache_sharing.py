"""Tests of fa4gen.cache shared between users and processes: read-only caches owned by root and
used by another uid, trust of every directory, pins against eviction and `clear`, and the
progress and pinning of fa4gen.build. CPU only; fake artifacts, no compiler."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from fa4gen import cache as cache_mod
from fa4gen.cache import (
    DEFAULT_ENV,
    SIZE_LIMIT_ENV,
    TRUSTED_ENV,
    CacheCorruptionWarning,
    CacheError,
    CacheSizeWarning,
    KernelCache,
    ReadOnlyCacheError,
    UntrustedCacheError,
    make_key,
)

WORKER = Path(__file__).with_name("_cache_worker.py")
NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0,
    reason="needs root to drop to uid 65534 (nobody) and to chown: run the suite as root (as CI does)",
)


def fake_build(out: Path) -> None:
    (out / "kernel.so").write_bytes(os.urandom(2048))
    (out / "sub").mkdir()
    (out / "sub" / "plan.json").write_text('{"tile_m": 128}')


def key_of(i: object) -> str:
    return make_key({"sharing": i})


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its (size, mtime_ns): to show that nothing changed."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if not p.is_dir()
    }


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (DEFAULT_ENV, SIZE_LIMIT_ENV, TRUSTED_ENV):
        monkeypatch.delenv(name, raising=False)


def as_user(uid: int, action: Callable[[], Any]) -> dict[str, Any]:
    """Run `action` in a forked child that dropped to `uid` (no exec: the interpreter and every
    module it needs are already loaded); {"ok": result} or {"error": type, "message": text}."""
    import diskcache  # noqa: F401 - imported here: the child may not be able to read the venv

    import fa4gen.cache_archive  # noqa: F401

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    result: dict[str, Any] = {"ok": action()}
                except Exception as exc:
                    result = {"error": type(exc).__name__, "message": str(exc)}
            result["warnings"] = [str(w.message) for w in caught]
            os.write(write_end, json.dumps(result, default=str).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    assert data, "the child process died before it reported"
    return json.loads(data)


@pytest.fixture
def shared_root():
    """A directory every uid can reach (pytest's tmp_path is private to root)."""
    top = Path(tempfile.mkdtemp(prefix="fa4gen-shared-"))
    os.chmod(top, 0o755)
    yield top
    shutil.rmtree(top, ignore_errors=True)


def image_cache(top: Path) -> tuple[Path, list[str]]:
    """What examples/ci/Dockerfile ships: a cache warmed by root, then `chmod -R a+rX,go-w`."""
    root = top / "fa4gen-cache"
    keys = [key_of("a"), key_of("b")]
    with KernelCache(root) as cache:
        for key in keys:
            cache.get_or_build(key, {"n": key}, fake_build)
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        os.chmod(path, (mode | 0o444 | (0o111 if path.is_dir() else 0)) & ~0o022)
    return root, keys


# --------------------------------------------------------------------------- read-only caches
@needs_root
def test_root_owned_read_only_cache_serves_hits_to_another_user(shared_root):
    root, keys = image_cache(shared_root)
    expected = {key: digest(root / "entries" / key / "kernel.so") for key in keys}
    before = tree(root)

    def use() -> dict[str, Any]:
        cache = KernelCache(root)
        with cache.pinned():  # a shared flock through a read-only descriptor
            found = {key: digest(cache.lookup(key).file("kernel.so")) for key in keys}
            _, built = cache.get_or_build(keys[0], {}, fake_build)
        errors = {}
        for name, call in (
            ("miss", lambda: cache.get_or_build(key_of("new"), {}, fake_build)),
            ("clear", cache.clear),
            ("drop", lambda: cache.drop_files({"x"})),
            ("import", lambda: cache.import_(root / "absent.tar.gz")),
        ):
            try:
                call()
            except ReadOnlyCacheError as exc:
                errors[name] = str(exc)
        return {
            "found": found,
            "built": built,
            "listed": len(cache.entries()),
            "verified": cache.verify(),
            "errors": errors,
        }

    report = as_user(NOBODY, use)
    assert "error" not in report, report
    result = report["ok"]
    assert result["found"] == expected and result["built"] is False and result["listed"] == 2
    assert result["verified"] == [[key, None] for key in sorted(keys)]
    assert set(result["errors"]) == {"miss", "clear", "drop", "import"}
    for message in result["errors"].values():
        assert "\n" not in message and "read-only for this process (uid 65534" in message
    assert f"set {DEFAULT_ENV} to a directory you can write" in result["errors"]["miss"]
    assert report["warnings"] == []
    assert tree(root) == before  # nothing written, nothing removed


@needs_root
def test_cache_another_user_can_write_is_refused_for_nobody(shared_root):
    root, keys = image_cache(shared_root)
    for path in [root, *root.rglob("*")]:
        os.chown(path, 12345, 12345, follow_symlinks=False)
    report = as_user(NOBODY, lambda: KernelCache(root).lookup(keys[0]) is not None)
    assert report["error"] == "UntrustedCacheError"
    assert "owned by uid 12345, another user" in report["message"] and TRUSTED_ENV in report["message"]
    report = as_user(NOBODY, lambda: KernelCache(root, trusted=True).lookup(keys[0]) is not None)
    assert report["ok"] is True


@needs_root
@pytest.mark.parametrize("sub", ["locks", "tmp", "entries"])
def test_root_owned_cache_with_a_directory_others_can_write_is_refused(shared_root, sub):
    root, keys = image_cache(shared_root)
    (root / sub).mkdir(exist_ok=True)
    os.chmod(root / sub, 0o777)
    report = as_user(NOBODY, lambda: KernelCache(root).lookup(keys[0]) is not None)
    assert report["error"] == "UntrustedCacheError"
    assert str(root / sub) in report["message"] and "world-writable" in report["message"]
    assert "as its owner" not in report["message"]  # root owns it: plain chmod advice


@needs_root
def test_unreadable_cache_is_one_clear_error(shared_root):
    root, keys = image_cache(shared_root)
    os.chmod(root, 0o700)  # what the warm stage leaves without `chmod -R a+rX`
    report = as_user(NOBODY, lambda: KernelCache(root).lookup(keys[0]) is not None)
    assert report["error"] == "CacheError"
    assert "cannot read the fa4gen cache directory" in report["message"]
    assert "chmod -R a+rX,go-w" in report["message"] and "\n" not in report["message"]


@needs_root
def test_root_owned_cache_is_trusted_by_root_and_another_owner_is_not(tmp_path):
    cache = KernelCache(tmp_path / "c")
    entry, _ = cache.get_or_build(key_of(1), {}, fake_build)
    for path in [tmp_path / "c", *(tmp_path / "c").rglob("*")]:
        os.chown(path, 0, 0)
    assert KernelCache(tmp_path / "c").lookup(key_of(1)) is not None
    os.chown(entry.path / "sub", 4321, -1)  # a subdirectory of one entry
    with pytest.raises(UntrustedCacheError, match=r"sub: it is owned by uid 4321"):
        KernelCache(tmp_path / "c").lookup(key_of(1))


def test_group_writable_subdirectory_of_an_entry_is_untrusted(tmp_path):
    cache = KernelCache(tmp_path / "c")
    entry, _ = cache.get_or_build(key_of(1), {}, fake_build)
    os.chmod(entry.path / "sub", 0o775)
    with pytest.raises(UntrustedCacheError, match="sub: it is group-writable"):
        cache.lookup(key_of(1))


# --------------------------------------------------------------------------- pins and eviction
def test_pinned_entry_survives_clear_and_eviction_from_another_process(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "EVICTION_GRACE_S", 0.0)
    root, key = tmp_path / "c", key_of("pinned")
    cache = KernelCache(root, size_limit=1)
    with pytest.warns(CacheSizeWarning):  # the one entry is over the limit, and kept
        expected = digest(cache.get_or_build(key, {}, fake_build)[0].file("kernel.so"))
    held, release = tmp_path / "held", tmp_path / "release"
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), str(root), key, "--no-compile", "--held", str(held), "--release", str(release)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not held.exists():
            assert time.monotonic() < deadline and worker.poll() is None, worker.stderr.read()
            time.sleep(0.01)
        assert cache.clear() == 0  # in use: skipped, not deleted under the reader
        cache._evict(keep=set())
        assert (root / "entries" / key / "kernel.so").exists()
    finally:
        release.touch()
        out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == [{"key": key, "hit": True, "built": False, "digest": expected}]
    assert cache.clear() == 1  # released when the reader finished


def test_one_build_call_keeps_all_its_kernels_under_a_tiny_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "EVICTION_GRACE_S", 0.0)  # only the pins protect them
    cache = KernelCache(tmp_path / "c", size_limit=100)
    keys = [key_of(("plan", i)) for i in range(4)]
    with pytest.warns(CacheSizeWarning) as record, cache.pinned():
        entries = [cache.get_or_build(key, {}, fake_build)[0] for key in keys]
        assert all(entry.file("kernel.so").exists() for entry in entries)
    assert len(record) == 1  # once per process and cache, not once per build
    message = str(record[0].message)
    assert "size limit of 100 bytes" in message and f"{SIZE_LIMIT_ENV}=1M or more" in message
    assert "\n" not in message
    assert sorted(e.key for e in cache.entries()) == sorted(keys)
    cache.get_or_build(key_of("later"), {}, fake_build)  # the pins are gone with the block
    assert [e.key for e in cache.entries()] == [key_of("later")]


def test_recently_used_entries_are_kept_and_warned_about_once(tmp_path):
    cache = KernelCache(tmp_path / "c", size_limit=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(3):
            cache.get_or_build(key_of(("recent", i)), {}, fake_build)
    assert len(cache.entries()) == 3
    assert [w.category for w in caught] == [CacheSizeWarning]
    assert "used in the last 60 minutes" in str(caught[0].message)


def test_fresh_build_is_verified_where_it_lies(tmp_path, monkeypatch):
    cache = KernelCache(tmp_path / "c")
    real_write = cache_mod._write_json

    def write_then_tamper(path: Path, doc: dict) -> None:
        real_write(path, doc)  # after the files were hashed: as if someone wrote into tmp/
        (path.parent / "kernel.so").write_bytes(b"swapped")

    monkeypatch.setattr(cache_mod, "_write_json", write_then_tamper)
    with pytest.raises(CacheError, match="fresh build of kernel .* does not verify .*sha256"):
        cache.get_or_build(key_of("fresh"), {}, fake_build)
    assert os.listdir(tmp_path / "c" / "entries") == []


def test_broken_entry_is_reported_once_even_when_its_removal_waits(tmp_path, caplog):
    cache = KernelCache(tmp_path / "c")
    key = key_of("broken")
    entry, _ = cache.get_or_build(key, {}, fake_build)
    entry.file("kernel.so").write_bytes(b"tampered")
    locked, release = threading.Event(), threading.Event()

    def hold_build_lock() -> None:  # another builder: the first lookup cannot remove it
        with cache._locked(key):
            locked.set()
            release.wait(10)

    holder = threading.Thread(target=hold_build_lock)
    holder.start()
    locked.wait(10)
    threading.Timer(0.2, release.set).start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, built = cache.get_or_build(key, {}, fake_build)
    holder.join(10)
    assert built
    assert [w.category for w in caught] == [CacheCorruptionWarning]
    assert "treating it as missing" in str(caught[0].message)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]  # no second report


# --------------------------------------------------------------------------- fa4gen.build
@pytest.fixture
def fake_compiler(monkeypatch):
    """fa4gen.build with the compile step replaced: artifacts of a few KiB, in milliseconds."""
    from fa4gen import api, compiler

    def build_artifact(spec, plan, emitted, out_dir: Path) -> dict[str, Any]:
        (out_dir / compiler.LIBRARY_FILE).write_bytes(os.urandom(64 * 1024))
        (out_dir / "plan.json").write_text(plan.model_dump_json())
        return {"compile_seconds": 0.0, "entry": compiler.ENTRY}

    def load_function(entry_dir: Path, cuda_flavour: str = "cu13"):
        return digest(Path(entry_dir) / compiler.LIBRARY_FILE)  # fails if it was evicted

    monkeypatch.setattr(compiler, "build_artifact", build_artifact)
    monkeypatch.setattr(api, "load_function", load_function)
    monkeypatch.setattr(cache_mod, "EVICTION_GRACE_S", 0.0)  # only the pins protect them


def test_build_under_a_tiny_limit_keeps_every_plan_and_reports_progress(tmp_path, monkeypatch, fake_compiler):
    import fa4gen

    spec = fa4gen.load_spec(Path(__file__).parents[1] / "specs" / "vit.yaml")
    monkeypatch.setenv(SIZE_LIMIT_ENV, "100K")  # smaller than the spec's set of plans
    root, lines = tmp_path / "c", []
    with pytest.warns(CacheSizeWarning):
        result = fa4gen.build(spec, "sm_90a", cache_dir=root, progress=lines.append)
    built = [result, *(b for _, b in result.splits)]
    assert len(built) >= 2 and all(b.entry.file("kernel.so").exists() for b in built)
    assert len(lines) == len(built)
    assert lines[0].startswith(f"compiled {spec.summary()} for sm_90a (default plan) in ")
    assert [line.split("(")[1].split(")")[0] for line in lines[1:]] == [
        f"{split.label} plan" for split, _ in result.splits
    ]
    again: list[str] = []
    fa4gen.build(spec, "sm_90a", cache_dir=root, progress=again.append)
    assert again == [f"cached {spec.summary()} for sm_90a ({line.split('(')[1].split(')')[0]})" for line in lines]
    kernel = fa4gen.compile(spec, arch="sm_90a", cache_dir=root)  # loads every plan's kernel
    assert len(kernel.splits) == len(result.splits)
