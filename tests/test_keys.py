"""The cache key: everything an artifact depends on, nothing about the machine."""

from __future__ import annotations

import fa4gen
from fa4gen import api, toolchain
from fa4gen.cache import make_key
from fa4gen.planner import seqlen_splits

SPEC = fa4gen.AttentionSpec(head_dim=64, causal=True)


def _key(spec=SPEC, **overrides):
    parts = api.cache_key_parts(spec, fa4gen.plan(spec, "sm_90a"), fa4gen.Arch.SM90A)
    parts.update(overrides)
    return make_key(parts)


def test_key_is_stable_and_holds_no_machine_facts(tmp_path, monkeypatch):
    import getpass
    import socket

    text = str(api.cache_key_parts(SPEC, fa4gen.plan(SPEC, "sm_90a"), fa4gen.Arch.SM90A))
    for fact in (socket.gethostname(), getpass.getuser(), str(tmp_path), "/home", "/root"):
        assert fact not in text
    monkeypatch.chdir(tmp_path)
    assert _key() == _key()


def test_equivalent_specs_share_a_key():
    assert _key(fa4gen.AttentionSpec(head_dim=64, causal=True)) == _key(
        fa4gen.AttentionSpec(head_dim=64, head_dim_v=64, window_right=0, softmax_scale=0.125)
    )


def test_every_ingredient_changes_the_key():
    base = _key()
    assert _key(fa4gen.AttentionSpec(head_dim=64)) != base
    assert _key(fa4gen={"version": "9.9.9", "sources": toolchain.source_fingerprint()}) != base
    assert _key(fa4gen={"version": fa4gen.__version__, "sources": "0" * 64}) != base
    assert _key(toolchain={"cutlass_dsl": "4.9.0", "cuda": "cu13"}) != base
    assert _key(toolchain={**toolchain.toolchain(), "cuda": "cu12"}) != base
    assert _key(arch="sm_100a") != base


def test_two_fa4gen_versions_never_load_each_others_artifacts(tmp_path, monkeypatch):
    built = []

    def fake_artifact(spec, plan, emitted, out_dir):
        (out_dir / "kernel.so").write_bytes(fa4gen.__version__.encode())
        built.append(fa4gen.__version__)
        return {"compile_seconds": 0.0}

    monkeypatch.setattr("fa4gen.compiler.build_artifact", fake_artifact)
    first = fa4gen.build(SPEC, "sm_90a", cache_dir=tmp_path)
    monkeypatch.setattr(api, "__version__", "0.0.0-other")
    monkeypatch.setattr(fa4gen, "__version__", "0.0.0-other")
    second = fa4gen.build(SPEC, "sm_90a", cache_dir=tmp_path)
    assert first.key != second.key and first.built_now and second.built_now
    per_build = 1 + len(seqlen_splits(SPEC, "sm_90a"))  # d64 causal: its short-sequence and 4 decode plans too
    assert per_build == 6 and len(built) == 2 * per_build
    monkeypatch.setattr(api, "__version__", first.entry.meta["fa4gen_version"])
    again = fa4gen.build(SPEC, "sm_90a", cache_dir=tmp_path)
    assert again.key == first.key and not again.built_now


def test_toolchain_override_for_runtime_only_machines(monkeypatch):
    toolchain.toolchain.cache_clear()
    monkeypatch.setenv(toolchain.TOOLCHAIN_ENV, "cutlass-dsl=4.8.1,cuda=cu13")
    try:
        assert toolchain.toolchain() == {"cutlass_dsl": "4.8.1", "cuda": "cu13"}
    finally:
        toolchain.toolchain.cache_clear()
