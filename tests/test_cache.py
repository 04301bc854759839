"""Tests of fa4gen.cache: the on-disk kernel artifact cache. CPU only, every root under tmp_path."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fa4gen import cache as cache_mod
from fa4gen.cache import (
    DEFAULT_ENV,
    SIZE_LIMIT_ENV,
    TRUSTED_ENV,
    CacheCorruptionWarning,
    CacheEntry,
    CacheError,
    CacheFullError,
    CacheMiss,
    KernelCache,
    UntrustedCacheError,
    default_cache_root,
    make_key,
    parse_size,
)

WORKER = Path(__file__).with_name("_cache_worker.py")
META = {"spec": {"head_dim": 128, "causal": True}, "arch": "sm90", "fa4gen": "0.1"}


class FakeBuild:
    """Writes a few artifact files (kernel.so random, so two builds differ) and counts calls."""

    def __init__(self, so_bytes: int = 4096, fail: BaseException | None = None):
        self.so_bytes = so_bytes
        self.fail = fail
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "kernel.so").write_bytes(os.urandom(self.so_bytes))
        (out / "kernel.py").write_text("def kernel():\n    pass\n")
        if self.fail is not None:
            raise self.fail
        (out / "spec.yaml").write_text("head_dim: 128\n")
        (out / "sub").mkdir()
        (out / "sub" / "plan.json").write_text('{"tile_m": 128}')


def key_of(i: object) -> str:
    return make_key({"test": i})


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (DEFAULT_ENV, SIZE_LIMIT_ENV, TRUSTED_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def run_worker(root: Path, *keys: str, **options: object) -> list[dict]:
    args = [sys.executable, str(WORKER), str(root), *keys]
    for name, value in options.items():
        flag = "--" + name.replace("_", "-")
        args += [flag] if value is True else [flag, str(value)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def lock_is_free(root: Path, key: str) -> bool:
    path = root / "locks" / f"{key}.lock"
    if not path.exists():
        return True
    with open(path, "rb") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


# --------------------------------------------------------------------------- keys and config
@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.integers() | st.text(max_size=8), min_size=1), st.randoms())
def test_make_key_ignores_insertion_order(parts, rng):
    items = list(parts.items())
    rng.shuffle(items)
    assert make_key(dict(items)) == make_key(parts)


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.text(max_size=8), st.integers(), min_size=1), st.data())
def test_make_key_changes_with_any_value(parts, data):
    name = data.draw(st.sampled_from(sorted(parts)))
    changed = {**parts, name: parts[name] + 1}
    assert make_key(changed) != make_key(parts)


def test_make_key_is_sha256_of_canonical_json():
    parts = {"b": [1, 2], "a": {"y": "é", "x": 1.5}}
    expected = hashlib.sha256(b'{"a":{"x":1.5,"y":"\\u00e9"},"b":[1,2]}').hexdigest()
    assert make_key(parts) == expected
    assert make_key({"a": {"x": 1.5, "y": "é"}, "b": [1, 2]}) == expected
    assert make_key({"a": 1}) != make_key({"a": "1"})
    with pytest.raises(TypeError):
        make_key([("a", 1)])


def test_default_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_root() == tmp_path / "home" / ".cache" / "fa4gen"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_cache_root() == tmp_path / "home" / ".cache" / "fa4gen"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_root() == tmp_path / "xdg" / "fa4gen"
    monkeypatch.setenv(DEFAULT_ENV, str(tmp_path / "explicit"))
    assert default_cache_root() == tmp_path / "explicit"
    assert KernelCache().root == tmp_path / "explicit"


def test_size_limit_parsing(monkeypatch, root):
    assert parse_size("123") == 123
    assert parse_size("500M") == 500 * 2**20
    assert parse_size("10G") == 10 * 2**30
    assert parse_size("1.5kib") == 1536
    assert parse_size(" 2 TB ") == 2 * 2**40
    for bad in ("ten", "-5", "5X", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    monkeypatch.setenv(SIZE_LIMIT_ENV, "64K")
    assert KernelCache(root).size_limit == 65536
    assert KernelCache(root, size_limit=10).size_limit == 10
    monkeypatch.setenv(SIZE_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match=SIZE_LIMIT_ENV):
        KernelCache(root)


def test_root_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="cannot use .*file as the fa4gen cache directory"):
        KernelCache(tmp_path / "file")


def test_invalid_key_and_reserved_meta_rejected(root):
    cache = KernelCache(root)
    build = FakeBuild()
    for bad in ("../../etc", "ABC", key_of(1).upper(), key_of(1) + "0"):
        with pytest.raises(ValueError, match="invalid cache key"):
            cache.lookup(bad)
    with pytest.raises(ValueError, match="files"):
        cache.get_or_build(key_of(1), {"files": {}}, build)
    with pytest.raises(TypeError):
        cache.get_or_build(key_of(1), {"x": object()}, build)
    assert build.calls == 0


# --------------------------------------------------------------------------- build protocol
def test_miss_then_hit_layout_and_meta(root, tmp_path):
    cache = KernelCache(root)
    key = key_of("layout")
    build = FakeBuild()
    assert cache.lookup(key) is None
    entry, built = cache.get_or_build(key, META, build)
    assert built and build.calls == 1
    again, built_again = cache.get_or_build(key, META, build)
    assert not built_again and build.calls == 1
    assert again.path == entry.path == root / "entries" / key
    assert (root / "index").is_dir() and (root / "locks" / f"{key}.lock").exists()
    assert listing(root / "tmp") == []

    files = {"kernel.so", "kernel.py", "spec.yaml", "sub/plan.json"}
    assert set(entry.meta["files"]) == files
    for name, digest in entry.meta["files"].items():
        assert hashlib.sha256(entry.file(name).read_bytes()).hexdigest() == digest
    assert entry.meta["size"] == sum(entry.file(n).stat().st_size for n in files)
    assert entry.meta["spec"] == META["spec"] and entry.meta["arch"] == "sm90"
    assert abs(entry.meta["created"] - time.time()) < 60
    assert again.meta["last_use"] >= entry.meta["created"]
    with pytest.raises(KeyError, match="nope"):
        entry.file("nope")

    text = (entry.path / "meta.json").read_text()
    assert str(tmp_path) not in text  # portable: no absolute paths
    doc = json.loads(text)
    assert doc["key"] == key and doc["meta"]["files"] == entry.meta["files"]


def test_hit_in_second_process_without_building(root, tmp_path):
    key = key_of("second-process")
    KernelCache(root).get_or_build(key, META, FakeBuild())
    log = tmp_path / "builds.log"
    [result] = run_worker(root, key, log=log, no_compile=True)
    assert result["hit"] and not result["built"]
    assert not log.exists()


def test_no_compile_raises_cache_miss_without_building(root):
    cache = KernelCache(root)
    build = FakeBuild()
    with pytest.raises(CacheMiss, match="kernel X was never compiled"):
        cache.get_or_build(key_of(1), META, build, no_compile=True, miss_message="kernel X was never compiled")
    with pytest.raises(CacheMiss, match=key_of(1)):
        cache.get_or_build(key_of(1), META, build, no_compile=True)
    assert build.calls == 0
    cache.get_or_build(key_of(1), META, build)
    entry, built = cache.get_or_build(key_of(1), META, build, no_compile=True)
    assert not built and build.calls == 1


def test_sixteen_processes_race_for_one_key(root, tmp_path):
    key = key_of("race")
    log, go = tmp_path / "builds.log", tmp_path / "go"
    procs = []
    for i in range(16):
        args = [
            sys.executable,
            str(WORKER),
            str(root),
            key,
            "--log",
            str(log),
            "--sleep",
            "0.5",
            "--ready",
            str(tmp_path / f"ready{i}"),
            "--go",
            str(go),
        ]
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"ready{i}").exists() for i in range(16)):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err
        results += json.loads(out.strip().splitlines()[-1])
    assert len(log.read_text().splitlines()) == 1  # exactly one build
    assert sum(r["built"] for r in results) == 1
    assert len({r["digest"] for r in results}) == 1
    on_disk = hashlib.sha256((root / "entries" / key / "kernel.so").read_bytes()).hexdigest()
    assert results[0]["digest"] == on_disk
    assert listing(root / "tmp") == []


def test_sigkilled_build_leaves_no_entry_and_no_lock(root, tmp_path):
    key = key_of("killed")
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(root), key, "--sleep", "60", "--started", str(started)])
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and proc.poll() is None, "worker never built"
            time.sleep(0.01)
        assert not lock_is_free(root, key)  # the builder holds it while building
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    assert lock_is_free(root, key)
    assert listing(root / "entries") == []
    assert len(listing(root / "tmp")) == 1  # the dead builder's half-written directory
    cache = KernelCache(root)
    assert cache.lookup(key) is None
    with pytest.raises(CacheMiss):
        cache.get_or_build(key, META, FakeBuild(), no_compile=True)
    build = FakeBuild()
    entry, built = cache.get_or_build(key, META, build)
    assert built and build.calls == 1 and cache.lookup(key) is not None
    assert listing(root / "tmp") == []  # the stale directory was swept
    assert lock_is_free(root, key)


def test_failing_build_leaves_nothing_and_reraises(root):
    cache = KernelCache(root)
    key = key_of("fails")
    with pytest.raises(ZeroDivisionError):
        cache.get_or_build(key, META, FakeBuild(fail=ZeroDivisionError("boom")))
    assert listing(root / "entries") == [] and listing(root / "tmp") == []
    assert lock_is_free(root, key) and cache.lookup(key) is None
    entry, built = cache.get_or_build(key, META, FakeBuild())
    assert built


def test_build_writing_symlink_or_nothing_is_rejected(root):
    cache = KernelCache(root)

    def symlink_build(out: Path) -> None:
        (out / "kernel.so").symlink_to("/etc/passwd")

    with pytest.raises(CacheError, match="not a regular file"):
        cache.get_or_build(key_of("link"), META, symlink_build)
    with pytest.raises(CacheError, match="no files"):
        cache.get_or_build(key_of("empty"), META, lambda out: None)
    with pytest.raises(CacheError, match="reserved"):
        cache.get_or_build(key_of("meta"), META, lambda out: (out / "meta.json").write_text("{}"))
    assert listing(root / "entries") == [] and listing(root / "tmp") == []


def test_stale_directory_without_meta_is_replaced(root):
    cache = KernelCache(root)
    key = key_of("stale")
    stale = root / "entries" / key
    stale.mkdir(parents=True)
    (stale / "kernel.so").write_bytes(b"half written")
    with pytest.warns(CacheCorruptionWarning, match="meta.json is missing"):
        entry, built = cache.get_or_build(key, META, FakeBuild())
    assert built and entry.file("kernel.so").read_bytes() != b"half written"


# --------------------------------------------------------------------------- integrity
def flip_byte(entry: CacheEntry) -> None:
    path = entry.file("kernel.so")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(entry: CacheEntry) -> None:
    with open(entry.file("kernel.so"), "r+b") as f:
        f.truncate(100)


def bad_meta_key(entry: CacheEntry) -> None:
    doc = json.loads((entry.path / "meta.json").read_text())
    doc["key"] = key_of("other")
    (entry.path / "meta.json").write_text(json.dumps(doc))


def unsafe_meta_name(entry: CacheEntry) -> None:
    doc = json.loads((entry.path / "meta.json").read_text())
    doc["meta"]["files"]["../../outside"] = "0" * 64
    (entry.path / "meta.json").write_text(json.dumps(doc))


CORRUPTIONS = {
    "flipped byte": (flip_byte, "sha256 of 'kernel.so'"),
    "truncated": (truncate, "sha256 of 'kernel.so'"),
    "deleted file": (lambda e: e.file("kernel.py").unlink(), "'kernel.py' is missing"),
    "deleted meta": (lambda e: (e.path / "meta.json").unlink(), "meta.json is missing"),
    "garbage meta": (lambda e: (e.path / "meta.json").write_text("{not json"), "does not parse"),
    "wrong key in meta": (bad_meta_key, "names key"),
    "unsafe name in meta": (unsafe_meta_name, "unsafe file name"),
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=list(CORRUPTIONS))
def test_corrupt_entry_is_missing_warned_removed_and_rebuilt(root, corrupt):
    damage, problem = CORRUPTIONS[corrupt]
    cache = KernelCache(root)
    key = key_of("corrupt")
    build = FakeBuild()
    entry, _ = cache.get_or_build(key, META, build)
    damage(entry)
    with pytest.warns(CacheCorruptionWarning, match=key) as record:
        assert cache.lookup(key) is None
    assert problem in str(record[0].message)
    assert not entry.path.exists()  # removed so the next build starts clean
    assert dict(cache.verify()) == {}
    rebuilt, built = cache.get_or_build(key, META, build)
    assert built and build.calls == 2 and cache.lookup(key) is not None


def test_corruption_detected_in_fresh_process(root, tmp_path):
    key = key_of("corrupt-subprocess")
    entry, _ = KernelCache(root).get_or_build(key, META, FakeBuild())
    flip_byte(entry)
    [result] = run_worker(root, key, no_compile=True)
    assert not result["hit"]


def test_verification_memoised_by_file_stats(root, monkeypatch):
    cache = KernelCache(root)
    key = key_of("memo")
    entry, _ = cache.get_or_build(key, META, FakeBuild())
    hashed: list[str] = []
    real = cache_mod._sha256_file
    monkeypatch.setattr(cache_mod, "_sha256_file", lambda p: hashed.append(p.name) or real(p))
    cache.lookup(key)
    cache.lookup(key)
    assert hashed.count("kernel.so") == 2  # just written: too fresh to trust (size, mtime)

    old = time.time() - 3600
    for name in entry.meta["files"]:
        os.utime(entry.file(name), (old, old))
    hashed.clear()
    assert cache.lookup(key) is not None and cache.lookup(key) is not None
    assert hashed.count("kernel.so") == 1  # second lookup answered from the per-process memo

    with open(entry.file("kernel.so"), "ab") as f:
        f.write(b"appended")
    with pytest.warns(CacheCorruptionWarning):
        assert cache.lookup(key) is None
    assert cache.verify() == []  # the broken entry was removed


def test_verify_reports_every_entry(root):
    cache = KernelCache(root)
    good, bad = key_of("good"), key_of("bad")
    cache.get_or_build(good, META, FakeBuild())
    entry, _ = cache.get_or_build(bad, META, FakeBuild())
    truncate(entry)
    report = dict(cache.verify())
    assert report[good] is None
    assert "sha256 of 'kernel.so'" in report[bad]
    assert entry.path.exists()  # verify only reports


def test_drop_files_rewrites_the_records_and_keeps_entries_loadable(root):
    cache = KernelCache(root)
    keys = [key_of("drop-a"), key_of("drop-b")]
    for key in keys:
        cache.get_or_build(key, META, FakeBuild())
    broken, _ = cache.get_or_build(key_of("drop-broken"), META, FakeBuild())
    truncate(broken)
    before = {e.key: e for e in cache.entries()}
    assert cache.drop_files({"kernel.py", "sub/plan.json", "absent.txt"}) == 2
    for key in keys:
        entry = cache.lookup(key)
        assert entry is not None and set(entry.meta["files"]) == {"kernel.so", "spec.yaml"}
        assert entry.meta["size"] == sum(entry.file(n).stat().st_size for n in entry.meta["files"])
        assert not (entry.path / "kernel.py").exists() and not (entry.path / "sub" / "plan.json").exists()
        assert entry.meta["created"] == before[key].meta["created"]
        assert entry.meta["spec"] == META["spec"]
    assert dict(cache.verify())[keys[0]] is None
    assert "kernel.py" in broken.meta["files"] and (broken.path / "kernel.py").exists()  # left alone
    assert listing(root / "tmp") == []
    assert cache.drop_files({"kernel.py"}) == 0  # nothing left to drop


def test_drop_files_keeps_an_entrys_last_file_and_its_last_use(root):
    cache = KernelCache(root)
    key = key_of("drop-last")
    cache.get_or_build(key, META, FakeBuild())
    used = next(e for e in cache.entries() if e.key == key).meta["last_use"]
    time.sleep(0.02)
    every = {"kernel.so", "kernel.py", "spec.yaml", "sub/plan.json"}
    assert cache.drop_files(every) == 0  # an entry with no file would be no entry
    assert cache.drop_files({"spec.yaml"}) == 1
    assert next(e for e in cache.entries() if e.key == key).meta["last_use"] == used


# --------------------------------------------------------------------------- disk full
def test_enospc_in_build_is_cache_full_and_leaves_nothing(root):
    cache = KernelCache(root)
    key = key_of("full")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "kernel.so")
    with pytest.raises(CacheFullError) as info:
        cache.get_or_build(key, META, FakeBuild(fail=full))
    message = str(info.value)
    assert str(root / "tmp") in message and "free" in message and "MiB" in message
    assert info.value.__cause__ is full
    assert listing(root / "entries") == [] and listing(root / "tmp") == []
    assert lock_is_free(root, key)


def test_enospc_wrapped_by_build_is_detected(root):
    def build(out: Path) -> None:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as exc:
            raise RuntimeError("compiler failed") from exc

    with pytest.raises(CacheFullError):
        KernelCache(root).get_or_build(key_of("wrapped"), META, build)
    assert listing(root / "tmp") == []


def test_enospc_writing_meta_json_leaves_nothing(root, monkeypatch):
    cache = KernelCache(root)
    key = key_of("meta-full")

    def full_write(path: Path, doc: dict) -> None:
        with open(path, "w") as f:
            f.write('{"format": 1, "key": "half')  # a partial write, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(cache_mod, "_write_json", full_write)
    with pytest.raises(CacheFullError, match="disk full"):
        cache.get_or_build(key, META, FakeBuild())
    assert listing(root / "entries") == [] and listing(root / "tmp") == []
    monkeypatch.undo()
    assert cache.lookup(key) is None
    assert cache.get_or_build(key, META, FakeBuild())[1]


# --------------------------------------------------------------------------- trust
def test_new_root_is_private_and_files_not_group_writable(root):
    cache = KernelCache(root)
    assert stat.S_IMODE(root.stat().st_mode) & 0o077 == 0

    def loose_build(out: Path) -> None:
        (out / "kernel.so").write_bytes(b"\x7fELF")
        os.chmod(out / "kernel.so", 0o777)
        (out / "d").mkdir()
        os.chmod(out / "d", 0o777)
        (out / "d" / "x.py").write_text("x = 1\n")

    entry, _ = cache.get_or_build(key_of("modes"), META, loose_build)
    for path in [entry.path, entry.path / "d", *(entry.path / n for n in entry.meta["files"])]:
        assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0, path
    assert stat.S_IMODE(entry.file("kernel.so").stat().st_mode) & 0o111 == 0
    assert stat.S_IMODE((entry.path / "meta.json").stat().st_mode) & ~0o644 == 0


@pytest.mark.parametrize("sub", ["", "entries", "index", "locks", "tmp"])
def test_writable_by_others_is_untrusted(root, sub, monkeypatch):
    KernelCache(root).get_or_build(key_of(1), META, FakeBuild())
    target = root / sub if sub else root
    os.chmod(target, 0o777)
    with pytest.raises(UntrustedCacheError) as info:
        KernelCache(root)
    message = str(info.value)
    assert str(target) in message and "0o777" in message and "world-writable" in message
    assert "chmod go-w" in message and TRUSTED_ENV in message
    assert KernelCache(root, trusted=True).lookup(key_of(1)) is not None
    monkeypatch.setenv(TRUSTED_ENV, "1")
    assert KernelCache(root).lookup(key_of(1)) is not None
    monkeypatch.setenv(TRUSTED_ENV, "0")
    os.chmod(target, 0o770)
    with pytest.raises(UntrustedCacheError, match="group-writable"):
        KernelCache(root)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
def test_owned_by_other_uid_is_untrusted(root):
    KernelCache(root)
    os.chown(root, 12345, -1)
    with pytest.raises(UntrustedCacheError, match="uid 12345"):
        KernelCache(root)
    KernelCache(root, trusted=True)


def test_tampered_entry_permissions_are_untrusted(root):
    cache = KernelCache(root)
    entry, _ = cache.get_or_build(key_of("perm"), META, FakeBuild())
    os.chmod(entry.file("kernel.so"), 0o666)
    with pytest.raises(UntrustedCacheError, match="kernel.so"):
        cache.lookup(key_of("perm"))
    assert KernelCache(root, trusted=True).lookup(key_of("perm")) is not None


# --------------------------------------------------------------------------- portability, index
def test_copied_cache_is_fully_hit_in_new_process(root, tmp_path):
    keys = [key_of(i) for i in range(4)]
    with KernelCache(root) as cache:  # closes the index before the copy
        for key in keys:
            cache.get_or_build(key, {**META, "i": key}, FakeBuild())
    copy = tmp_path / "elsewhere" / "copied"
    shutil.copytree(root, copy)
    shutil.rmtree(root)  # nothing may point back at the original location
    log = tmp_path / "builds.log"
    results = run_worker(copy, *keys, log=log)
    assert [r["hit"] for r in results] == [True] * 4
    assert not log.exists()


def test_index_deleted_or_corrupt_is_not_fatal(root):
    cache = KernelCache(root)
    keys = [key_of(i) for i in range(3)]
    for key in keys:
        cache.get_or_build(key, META, FakeBuild())
    shutil.rmtree(root / "index")
    assert all(cache.lookup(k) is not None for k in keys)  # same instance, index gone under it
    assert all(KernelCache(root).lookup(k) is not None for k in keys)
    cache.close()
    shutil.rmtree(root / "index", ignore_errors=True)  # hits no longer rewrite the index
    (root / "index").mkdir()
    (root / "index" / "cache.db").write_bytes(b"this is not a sqlite database" * 100)
    fresh = KernelCache(root)
    assert all(fresh.lookup(k) is not None for k in keys)
    assert sorted(e.key for e in fresh.entries()) == sorted(keys)
    assert fresh.get_or_build(key_of("new"), META, FakeBuild())[1]


def test_entries_merge_last_use_from_index(root):
    cache = KernelCache(root)
    first, second = key_of("first"), key_of("second")
    cache.get_or_build(first, {"name": "a"}, FakeBuild())
    cache.get_or_build(second, {"name": "b"}, FakeBuild())
    used = cache.lookup(first).meta["last_use"]
    listed = cache.entries()
    assert [e.key for e in listed] == [first, second]  # most recently used first
    assert listed[0].meta["last_use"] == pytest.approx(used)
    assert listed[0].meta["name"] == "a" and listed[0].meta["size"] > 0
    shutil.rmtree(root / "index")
    fallback = KernelCache(root).entries()  # hits mark the entry directory: order survives
    assert [e.key for e in fallback] == [first, second]
    assert all(e.meta["last_use"] >= e.meta["created"] for e in fallback)


def test_lru_eviction_keeps_recent_and_just_built(root, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "EVICTION_GRACE_S", 0.0)  # every entry here is seconds old
    probe = KernelCache(tmp_path / "probe")
    per_entry = probe.get_or_build(key_of("probe"), META, FakeBuild(1000))[0].meta["size"]
    cache = KernelCache(root, size_limit=3 * per_entry)
    a, b, c, d, e = (key_of(x) for x in "abcde")
    for key in (a, b, c):
        cache.get_or_build(key, META, FakeBuild(1000))
    assert {x.key for x in cache.entries()} == {a, b, c}
    cache.lookup(a)  # a is now the most recently used
    cache.get_or_build(d, META, FakeBuild(1000))
    assert {x.key for x in cache.entries()} == {a, c, d}  # b was least recently used
    assert not (root / "locks" / f"{b}.lock").exists()

    tiny = KernelCache(root, size_limit=10)
    with pytest.warns(cache_mod.CacheSizeWarning, match="size limit of 10 bytes"):
        tiny.get_or_build(e, META, FakeBuild(1000))
    assert [x.key for x in tiny.entries()] == [e]  # the just-built entry always stays


def test_clear_all_and_by_predicate(root):
    cache = KernelCache(root)
    for i in range(4):
        cache.get_or_build(key_of(i), {"arch": "sm90" if i % 2 else "sm100"}, FakeBuild())
    broken = root / "entries" / key_of("broken")
    broken.mkdir()
    assert cache.clear(predicate=lambda e: e.meta["arch"] == "sm90") == 2
    assert {e.key for e in cache.entries()} == {key_of(0), key_of(2)}
    assert cache.clear() == 3  # includes the broken directory
    assert listing(root / "entries") == [] and cache.entries() == []


# --------------------------------------------------------------------------- export / import
def test_export_import_round_trip(root, tmp_path):
    source = KernelCache(root)
    keys = [key_of(i) for i in range(3)]
    digests = {}
    for key in keys:
        entry, _ = source.get_or_build(key, {**META, "n": key}, FakeBuild())
        digests[key] = entry.meta["files"]
    archive = tmp_path / "kernels.tar.gz"
    assert source.export(archive) == 3
    assert not list(tmp_path.glob(".*partial"))
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert all(not n.startswith("/") and ".." not in n for n in names)

    target = KernelCache(tmp_path / "fresh")
    assert target.import_(archive) == 3
    for key in keys:
        entry = target.lookup(key)
        assert entry is not None and entry.meta["files"] == digests[key]
        assert entry.meta["n"] == key
    assert target.import_(archive) == 0  # already present
    assert listing(tmp_path / "fresh" / "tmp") == []
    assert target.get_or_build(keys[0], META, FakeBuild(), no_compile=True)[1] is False


def make_archive(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def file_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def link_member(name: str, kind: bytes, target: str = "/etc/passwd"):
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info, None


BAD_MEMBERS = {
    "dotdot": [file_member("../evil", b"x")],
    "nested dotdot": [file_member(f"{key_of(1)}/../../evil", b"x")],
    "absolute": [file_member("/tmp/evil", b"x")],
    "symlink": [link_member(f"{key_of(1)}/kernel.so", tarfile.SYMTYPE)],
    "hardlink": [link_member(f"{key_of(1)}/kernel.so", tarfile.LNKTYPE)],
    "device": [link_member(f"{key_of(1)}/dev", tarfile.CHRTYPE, "")],
    "not a key": [file_member("somedir/kernel.so", b"x")],
}


@pytest.mark.parametrize("kind", BAD_MEMBERS, ids=list(BAD_MEMBERS))
def test_import_rejects_unsafe_members(root, tmp_path, kind):
    archive = make_archive(tmp_path / "bad.tar.gz", BAD_MEMBERS[kind])
    cache = KernelCache(root)
    with pytest.raises(CacheError, match="refusing to import"):
        cache.import_(archive)
    assert not (tmp_path / "evil").exists() and not (root / "evil").exists()
    assert listing(root / "entries") == [] and listing(root / "tmp") == []


def test_import_rejects_non_archive(root, tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"definitely not gzip")
    with pytest.raises(CacheError, match="cannot read cache archive"):
        KernelCache(root).import_(junk)


def rewrite_archive(src: Path, dst: Path, change) -> Path:
    members = []
    with tarfile.open(src) as tar:
        for info in tar.getmembers():
            data = tar.extractfile(info).read()
            members.extend(change(info, data))
    return make_archive(dst, [file_member(info.name, data) for info, data in members])


def test_import_skips_tampered_entries(root, tmp_path):
    source = KernelCache(root)
    good, bad = key_of("good"), key_of("bad")
    source.get_or_build(good, META, FakeBuild())
    source.get_or_build(bad, META, FakeBuild())
    archive = tmp_path / "kernels.tar.gz"
    assert source.export(archive) == 2

    def tamper(info, data):
        if info.name == f"{bad}/kernel.so":
            data = b"\x00evil" + data[5:]
        return [(info, data)]

    tampered = rewrite_archive(archive, tmp_path / "tampered.tar.gz", tamper)
    target = KernelCache(tmp_path / "fresh")
    with pytest.warns(CacheCorruptionWarning, match=f"not importing entry {bad}"):
        assert target.import_(tampered) == 1
    assert target.lookup(good) is not None and target.lookup(bad) is None
    assert not (tmp_path / "fresh" / "entries" / bad).exists()

    def smuggle(info, data):
        if info.name != f"{good}/meta.json":
            return [(info, data)]
        return [(info, data), (tarfile.TarInfo(f"{good}/extra.so"), b"unlisted")]

    smuggled = rewrite_archive(archive, tmp_path / "smuggled.tar.gz", smuggle)
    other = KernelCache(tmp_path / "other")
    with pytest.warns(CacheCorruptionWarning, match="does not list"):
        assert other.import_(smuggled) == 1
    assert other.lookup(good) is None and other.lookup(bad) is not None


def test_module_does_not_import_torch_or_cutlass():
    # Load the cache modules with an empty fa4gen package (its __init__ not run), so only the
    # cache's own imports count.
    code = (
        "import importlib, os, sys, types\n"
        "package = types.ModuleType('fa4gen')\n"
        "package.__path__ = [os.path.dirname(sys.argv[2])]\n"
        "sys.modules['fa4gen'] = package\n"
        "module = importlib.import_module('fa4gen.cache')\n"
        "module.KernelCache(sys.argv[1]).lookup(module.make_key({}))\n"
        "bad = {'torch', 'cutlass', 'tvm_ffi'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not bad, bad\n"
    )
    with tempfile.TemporaryDirectory() as root:
        subprocess.run([sys.executable, "-c", code, root, cache_mod.__file__], check=True, timeout=60)


def test_removed_lock_file_is_never_held_twice(root):
    """Waiters blocked on a lock file that is then unlinked (removal of its entry) must not run
    alongside newcomers that lock the new file at the same path."""
    cache = KernelCache(root)
    key = key_of("lock")
    cache.get_or_build(key, META, FakeBuild())
    guard = threading.Lock()
    holders, most = [0], [0]

    def worker() -> None:
        with cache._locked(key):
            with guard:
                holders[0] += 1
                most[0] = max(most[0], holders[0])
            time.sleep(0.1)
            with guard:
                holders[0] -= 1

    waiters = [threading.Thread(target=worker) for _ in range(3)]
    with cache._locked(key):
        for thread in waiters:
            thread.start()
        time.sleep(0.3)  # every waiter has opened the old lock file and blocks on it
        assert cache._remove_locked(key)  # as clear() and eviction do: unlinks the lock file
        newcomers = [threading.Thread(target=worker) for _ in range(3)]
        for thread in newcomers:
            thread.start()
        time.sleep(0.05)
    for thread in waiters + newcomers:
        thread.join(10)
    assert most[0] == 1
    assert lock_is_free(root, key)


def test_import_rejects_duplicate_members(root, tmp_path):
    name = f"{key_of(1)}/kernel.so"
    members = [file_member(name, b"a"), file_member(name, b"b")]
    archive = make_archive(tmp_path / "dup.tar.gz", members)
    with pytest.raises(CacheError, match="duplicate"):
        KernelCache(root).import_(archive)
    assert listing(root / "tmp") == []
