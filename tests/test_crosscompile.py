"""Cross-compile every spec in specs/ for sm_90a on this (GPU-less) machine and inspect the code.

The PTX and the SASS (nvdisasm, from the nvidia-cuda-nvdisasm wheel) must show the Hopper
machinery the plan promises: warpgroup MMAs issued back to back (not serialized by ptxas), TMA
bulk-tensor loads, setmaxnreg register reallocation, and no local-memory traffic (register spills).
"""

from __future__ import annotations

import collections
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def _nvdisasm() -> str | None:
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for candidate in sorted(Path(root).glob("*/bin/nvdisasm")):
            return str(candidate)
    return None


# specs whose first-call plans (planner.first_call_plan) are cross-compiled too: one per kind of
# loop body they collapse (mask runs with a left bound, causal mask runs, chain + interior first tile)
FIRST_CALL_SPECS = ("mistral-7b", "llama3-8b", "vit")
DETERMINISTIC_SPECS = ("llama3-8b", "llama4-chunked", "packed-documents")  # backwards also built deterministic
SOFTCAP_BACKWARD_SPILLS = 32  # spill instructions a soft-capped backward may have (22-28 measured)
# a d128 backward that trains tensors keeps their shares beside S^T and dP^T (58-65 measured:
# expression-score with its soft cap, ALiBi GQA 4; T5's d64 none)
TRAINING_TENSORS_SPILLS = 72


@pytest.fixture(scope="module")
def artifacts(warm_cache):
    """Every built forward kernel: each spec's default plan, its forward plans for length ranges,
    and the first-call plans of FIRST_CALL_SPECS."""
    import fa4gen
    from fa4gen.planner import first_call_plan

    root, results = warm_cache
    found = dict(results)
    found.update(
        {
            f"{name}.{split.label}": built
            for name, result in results.items()
            for split, built in result.splits
            if not split.plan.is_decode  # (decode kernels: every_artifact)
        }
    )
    for name in FIRST_CALL_SPECS:
        quick = first_call_plan(results[name].plan)
        assert quick is not None, f"{name}'s plan has no first-call plan: pick another spec"
        found[f"{name}.first-call"] = fa4gen.build(results[name].spec, "sm_90a", cache_dir=root, kernel_plan=quick)
    return found


@pytest.fixture(scope="module")
def every_artifact(artifacts, warm_cache):
    """The forward kernels, and the decode kernel and the backward of every spec in specs/ that has them."""
    import fa4gen
    from fa4gen.api import training_spec
    from fa4gen.planner import backward_plan, backward_problem

    root, results = warm_cache
    found = dict(artifacts)
    found.update(
        {
            f"{name}.{split.label}": built
            for name, result in results.items()
            for split, built in result.splits
            if split.plan.is_decode
        }
    )
    assert any(result.plan.is_decode for result in found.values()), "no spec in specs/ has a decode kernel"
    for name, result in results.items():
        if not backward_problem(result.spec):
            spec = training_spec(result.spec)
            found[f"{name}.backward"] = fa4gen.build(spec, "sm_90a", cache_dir=root, kernel_plan=backward_plan(spec))
    assert any(name.endswith(".backward") for name in found), "no spec in specs/ has a backward"
    for name in DETERMINISTIC_SPECS:
        spec = training_spec(results[name].spec).model_copy(update={"deterministic": True})
        found[f"{name}.backward-deterministic"] = fa4gen.build(
            spec, "sm_90a", cache_dir=root, kernel_plan=backward_plan(spec)
        )
        # dQ's turns dealt over groups (Sm90BwdConfig.dq_grouped_turns): off in the planner until
        # measured on a GPU, compiled here so that it keeps building without spills
        grouped = backward_plan(spec).with_config("cross-compiled while off", dq_grouped_turns=True)
        found[f"{name}.backward-grouped"] = fa4gen.build(spec, "sm_90a", cache_dir=root, kernel_plan=grouped)
    # the backward computed transposed (dkv_split t, 96-key tiles): an option until measured on a
    # GPU, compiled here so that it keeps building without spills (d192/128 with its LSE)
    wide = next(name for name, result in results.items() if result.spec.head_dim == 192 and result.spec.dv == 128)
    spec = training_spec(results[wide].spec)
    transposed = backward_plan(spec).with_config("cross-compiled while off", dkv_split="t", keys_per_warpgroup=48)
    found[f"{wide}.backward-transposed"] = fa4gen.build(spec, "sm_90a", cache_dir=root, kernel_plan=transposed)
    return found


def test_only_a_deterministic_backward_takes_turns_at_dq(every_artifact):
    """Deterministic: each warpgroup spins on its query tile's semaphore (an acquire load) before
    its dQ reduce-add and passes the turn with a release add; otherwise no semaphore at all."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    for name, result in every_artifact.items():
        if not result.plan.is_backward:
            continue
        sass = subprocess.run(
            [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
        ).stdout
        turns = len(re.findall(r"REDG\.E\.ADD\.S32\.STRONG\.GPU", sass))
        assert "UTMAREDG" in sass, f"{name}: dQ without its TMA reduce-add"
        if result.plan.config.deterministic:
            assert turns >= 2 and "MEMBAR.ALL.GPU" in sass and "FENCE.VIEW.ASYNC.G" in sass, name
        else:
            assert turns == 0, f"{name}: a semaphore in a backward that sums dQ in any order"


def test_decode_kernels_merge_splits_in_their_last_cta(every_artifact):
    """A decode kernel is one kernel (no second launch merges the splits): its last split counts
    in with one atomic add after a GPU-scope fence; a paged one hands each box its page by
    shuffle. Neither waits on another CTA (no spin loop to deadlock on)."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    decode = {name: result for name, result in every_artifact.items() if result.plan.is_decode}
    assert any(r.plan.config.paged for r in decode.values()) and any(not r.plan.config.paged for r in decode.values())
    for name, result in decode.items():
        sass = subprocess.run(
            [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
        ).stdout
        assert sass.count("\t.section\t.text.") == 1, f"{name}: more than one kernel"
        assert len(re.findall(r"ATOMG\.E\.ADD\S*\.GPU", sass)) == 1 and "MEMBAR.ALL.GPU" in sass, name
        if result.plan.config.paged:  # a shuffle per box of a key tile at least
            assert sass.count("SHFL.IDX") >= result.plan.config.tile_n // 16, name


def test_length_range_plans_are_built_beside_the_default(warm_cache):
    from fa4gen.planner import seqlen_splits

    _, results = warm_cache
    labels = set()
    for name, result in results.items():
        splits = seqlen_splits(result.spec, "sm_90a")
        assert [split for split, _ in result.splits] == list(splits), name
        for split, built in result.splits:
            labels.add(split.label)
            assert built.plan == split.plan and built.key != result.key and built.entry.path.is_dir(), name
    # phi3-mini (d96) is the spec in specs/ with short and long ranges; every spec but packed
    # documents and prefix-LM has a decode range and the KV-cache kernels (128 rows; paged)
    expected = {"short", "long", "decode", "decode-wide", "paged", "paged-wide"}
    assert labels == expected, "a plan no spec in specs/ has would go uncompiled in CI"


def test_every_spec_compiles_to_a_complete_entry(every_artifact):
    assert every_artifact, "specs/ is empty"
    for name, result in every_artifact.items():
        files = {p.name for p in result.entry.path.iterdir()}
        assert {"kernel.so", "kernel.py", "kernel.ptx", "kernel.cubin", "plan.json", "spec.yaml"} <= files, name
        info = json.loads((result.entry.path / "build.json").read_text())
        assert info["compile_seconds"] > 0


def test_ptx_uses_hopper_machinery(every_artifact):
    for name, result in every_artifact.items():
        ptx = (result.entry.path / "kernel.ptx").read_text()
        assert ".target sm_90a" in ptx, name
        assert "wgmma.mma_async" in ptx, f"{name}: no warpgroup MMA"
        assert "cp.async.bulk.tensor" in ptx, f"{name}: no TMA load"
        assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx, f"{name}: no register reallocation"
        assert not re.search(r"\.local\b", ptx), f"{name}: local memory in PTX"


def test_a_shared_o_buffer_is_taken_in_turn(artifacts):
    """Where the warpgroups share one O staging tile (o_staging "shared": Gemma 2's d256 window in
    specs/), each warpgroup waits at its turn barrier for its own 128 threads and the previous
    one's storing warp (bar.sync, 160 threads), which arrives (bar.arrive, 160) once its store
    has read the tile. With O over the last V stage ("over_v": the d192 causal spec) there is no
    turn: warpgroup 0 arrives (bar.arrive, 256) once its last P.V has read the stage and
    warpgroup 1 waits there (bar.sync, 256) before it writes O over it; without ping-pong, whose
    turns take the same count, no other barrier spans both warpgroups."""
    kinds = set()
    for name, result in artifacts.items():
        ptx = (result.entry.path / "kernel.ptx").read_text()

        def count(op: str, threads: int, ptx: str = ptx) -> int:
            return len(re.findall(rf"\bbar\.{op}\s+%r\d+, {threads};", ptx))

        turns, both = (count("sync", 160), count("arrive", 160)), (count("sync", 256), count("arrive", 256))
        staging = result.plan.config.o_staging
        assert (min(turns) >= 1) if staging == "shared" else turns == (0, 0), f"{name}: {turns} turn barriers"
        if staging == "over_v":
            assert min(both) >= 1, f"{name}: {both} barriers between the warpgroups"
        elif not result.plan.config.pingpong:
            assert both == (0, 0), f"{name}: {both} barriers between the warpgroups"
        kinds.add(staging)
    assert {"shared", "over_v", "own"} <= kinds


def test_q_barriers_per_buffer_or_per_warpgroup(artifacts):
    """A full and an empty mbarrier per K and per V stage, and per Q buffer, or with
    config.q_per_warpgroup per warpgroup's 64 rows of each Q buffer (deepseek-style's d192 in
    specs/ has them, the others one pair per buffer)."""
    kinds = set()
    for name, result in artifacts.items():
        p = result.plan.config
        ptx = (result.entry.path / "kernel.ptx").read_text()
        q_slots = p.q_stages * (p.num_consumer_warpgroups if p.q_per_warpgroup else 1)
        inits = len(re.findall(r"\bmbarrier\.init\.shared\.b64\b", ptx))
        assert inits == 2 * (q_slots + 2 * p.kv_stages), f"{name}: {inits} mbarriers, {q_slots} Q slots"
        kinds.add(p.q_per_warpgroup)
    assert kinds == {True, False}


def test_p_conversions_are_pinned_exactly_where_a_rescale_threshold_branches(artifacts, warm_cache):
    """P's 16-bit conversions are volatile inline asm (layout.pack_pair_pinned) where a rescale
    threshold puts a branch after them, and plain conversions (which LLVM may sink) where O is
    rescaled every tile: sm90.mainloop.pins_p_conversions. Every spec in specs/ has the
    threshold (a stale max needs it), so vit's plan rescaling every tile, a tuning candidate,
    is built beside them."""
    import fa4gen

    root, results = warm_cache
    every_tile = results["vit"].plan.with_config("O rescaled every tile", rescale_threshold=0.0, stale_max=False)
    built = dict(artifacts)
    built["vit, O rescaled every tile"] = fa4gen.build(
        results["vit"].spec, "sm_90a", cache_dir=root, kernel_plan=every_tile
    )
    kinds = set()
    for name, result in built.items():
        ptx = (result.entry.path / "kernel.ptx").read_text()
        blocks = re.findall(r"// begin inline asm\n(.*?)// end inline asm", ptx, re.S)
        pinned = sum(1 for block in blocks if re.search(r"cvt\.rn\.(?:bf16|f16)x2\.f32", block))
        threshold = result.plan.config.rescale_threshold > 0.0
        assert (pinned > 0) == threshold, f"{name}: {pinned} pinned conversions, rescale threshold {threshold}"
        kinds.add(threshold)
    assert kinds == {True, False}


def test_transposed_backward_puts_keys_on_the_mma_n_side(every_artifact):
    """dkv_split t: every MMA of the step but dQ's is 64 x 48 (a warpgroup's 48 of the 96 keys
    on N: S, dP, dK^T, dV^T); dQ's is 64 x 96 (its half of the head dim over the shared dS)."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    (result,) = [r for name, r in every_artifact.items() if name.endswith(".backward-transposed")]
    sass = subprocess.run(
        [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
    ).stdout
    shapes = collections.Counter(re.findall(r"HGMMA\.(\d+x\d+x\d+)", sass))
    # k-blocks of 16: S over d 192 (12), dP over dv 128 (8), dK^T 3 x 4, dV^T 2 x 4; dQ over 96 keys (6)
    assert shapes == {"64x48x16": 12 + 8 + 12 + 8, "64x96x16": 6}, shapes


def test_sass_has_hgmma_and_no_spills(every_artifact):
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    for name, result in every_artifact.items():
        sass = subprocess.run(
            [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
        ).stdout
        assert "HGMMA" in sass, f"{name}: no HGMMA in SASS"
        assert "UTMALDG" in sass, f"{name}: no TMA load in SASS"
        spills = re.findall(r"\b(?:STL|LDL)\b", sass)
        # a soft-capped backward keeps tanh's values beside S^T and dP^T and spills a few
        # registers (decision bwd-tiles): bounded, so that more fails
        allowed = SOFTCAP_BACKWARD_SPILLS if result.plan.is_backward and result.plan.config.softcap else 0
        if result.plan.is_backward and result.plan.config.aux_grads:
            allowed = TRAINING_TENSORS_SPILLS if result.plan.config.head_dim_padded > 64 else 0
        assert len(spills) <= allowed, f"{name}: {len(spills)} local-memory (spill) instructions"
        # ptxas serializes every wgmma of a kernel it cannot prove safe to overlap (C7519,
        # C7520: a WARPGROUP.ARRIVE and a wait at each HGMMA; 0.57x at d128 on the H200)
        hgmma, arrive = sass.count("HGMMA"), sass.count("WARPGROUP.ARRIVE")
        assert arrive * 2 < hgmma, f"{name}: {arrive} warpgroup arrives for {hgmma} HGMMA: wgmma serialized"


def test_expression_division_is_straight_line_code(warm_cache):
    """An expression's `/` renders as div.full.f32 (decision expression-division): a plain
    float32 division's slow path is a called subroutine, and the call spilled 28 registers in
    this forward (192 CALLs)."""
    import fa4gen

    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    root, _ = warm_cache
    spec = fa4gen.AttentionSpec(
        head_dim=128,
        qhead_per_kvhead=4,
        causal=True,
        score_mod={"kind": "expression", "expr": "score + (kv_idx - q_idx) / seqlen_k"},
    )
    result = fa4gen.build(spec, "sm_90a", cache_dir=root, kernel_plan=fa4gen.plan(spec, "sm_90a"))
    assert "div.full.f32" in (result.entry.path / "kernel.ptx").read_text()
    sass = subprocess.run(
        [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
    ).stdout
    assert not re.findall(r"\b(?:STL|LDL|CALL\.\S+)\b", sass), "a division left a call or spills"


def _qk_steps_with_carry(sass: str) -> int:
    """Q.K^T HGMMAs (A and B both shared-memory descriptors) that continue a chain of k-blocks
    and were preceded, since the previous HGMMA, by a 64-bit add with carry (UIADD3.X)."""
    count, carried = 0, False
    for line in sass.splitlines():
        if "HGMMA" in line:
            qk = re.search(r"\bHGMMA\.\S+ R\d+, gdesc\[UR\d+\], (R\d+|RZ)", line)
            count += bool(qk and qk.group(1) != "RZ" and carried)
            carried = False
        elif "UIADD3.X" in line:
            carried = True
    return count


def test_q_descriptors_step_without_carry_at_small_head_dims(artifacts):
    """At d <= 64 the Q.K^T A operand is a view whose offset is known in whole swizzle atoms
    (HopperAttentionForward.q_rows), so ptxas ORs each k-block's offset into the descriptors:
    no k-block of a Q.K^T chain waits on a 64-bit add with carry (a plain slice of the Q buffer
    had one before each; 1.01-1.02x at d64 causal on the H200). Larger d keep the plain slice."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    small = {name: result for name, result in artifacts.items() if result.plan.config.head_dim_padded <= 64}
    assert small, "specs/ has no spec with d <= 64"
    for name, result in small.items():
        sass = subprocess.run(
            [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
        ).stdout
        assert _qk_steps_with_carry(sass) == 0, f"{name}: Q.K^T k-blocks stepped with a 64-bit carry"


def _loop_heads_to_first_vote(sass: str) -> list[list[str]]:
    """For every loop (a backward branch) whose body issues HGMMA: its instructions from the
    loop head up to its first VOTE.ANY (the whole body where it has none)."""
    labels, body = {}, []
    for line in sass.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line.strip())
        if label:
            labels[label.group(1)] = len(body)
        instruction = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(.*?);", line)
        if instruction:
            body.append(instruction.group(1))
    loops = []
    for end, text in enumerate(body):
        target = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if target and labels.get(target.group(1), end + 1) <= end:
            steps = body[labels[target.group(1)] : end + 1]
            if any("HGMMA" in t for t in steps):
                votes = [i for i, t in enumerate(steps) if "VOTE.ANY" in t]
                loops.append(steps[: votes[0]] if votes else steps)
    return loops


def test_stale_max_steps_exponentiate_without_a_row_max(artifacts):
    """With config.stale_max, some key-tile loop exponentiates a whole tile (tile_n / 2 MUFU.EX2
    per thread) before its first warp vote with at most the two FMNMX of the row-sum check, no
    tile max (tile_n / 2 - 1 FMNMX per row); without it, every loop finds the max first.
    specs/ has both kinds (d192, d256, documents and the expression mask keep the max)."""
    tool = _nvdisasm()
    if tool is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    kinds = set()
    for name, result in artifacts.items():
        sass = subprocess.run(
            [tool, "-c", str(result.entry.path / "kernel.cubin")], capture_output=True, text=True, check=True
        ).stdout
        exps = result.plan.config.tile_n // 2
        stale = [
            steps
            for steps in _loop_heads_to_first_vote(sass)
            if sum("MUFU.EX2" in t for t in steps) >= exps and sum("FMNMX" in t for t in steps) <= 2
        ]
        assert bool(stale) == result.plan.config.stale_max, f"{name}: {len(stale)} key-tile loops without a row max"
        kinds.add(result.plan.config.stale_max)
    assert kinds == {True, False}


def test_artifacts_hold_no_paths(every_artifact, warm_cache):
    root, _ = warm_cache
    for name, result in every_artifact.items():
        blob = (result.entry.path / "kernel.so").read_bytes()
        assert str(root).encode() not in blob, f"{name}: cache path baked into the shared object"
        assert b"/site-packages/" not in blob, f"{name}: install path baked into the shared object"
        meta = (result.entry.path / "meta.json").read_text()
        assert str(root) not in meta


def test_recompiling_is_byte_identical(artifacts, tmp_path):
    import fa4gen

    name, first = sorted(artifacts.items())[0]
    again = fa4gen.build(first.spec, "sm_90a", cache_dir=tmp_path)
    assert again.built_now and again.key == first.key
    assert (again.entry.path / "kernel.so").read_bytes() == (first.entry.path / "kernel.so").read_bytes(), name
