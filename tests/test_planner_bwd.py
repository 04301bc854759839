"""The backward planner (fa4gen.planner.sm90_bwd, fa4gen.kernels.sm90.bwd_config): tiles, the
feasibility check, deterministic dQ turns and the run-time launch choices of fa4gen.backward."""

from __future__ import annotations

import pytest

from fa4gen.planner import Plan, split_workspace_shape
from fa4gen.spec import AttentionSpec


def test_backward_plans_every_supported_head_dim_and_mask():
    from fa4gen.kernels.sm90.bwd_config import bwd_config_problem
    from fa4gen.planner import backward_plan

    for d in range(8, 257, 8):
        masks = (
            {},
            {"causal": True},
            {"window_left": 100, "window_right": 7},
            {"causal": True, "softcap": 30.0},
            {"causal": True, "mask": "document"},
            {"causal": True, "mask": {"kind": "expression", "expr": "q_idx - kv_idx < 300 or kv_idx < 4"}},
        )
        for mask in masks:
            p = backward_plan(AttentionSpec(head_dim=d, qhead_per_kvhead=4, **mask))
            assert p.kernel == "HopperAttentionBackward" and p.is_backward
            assert bwd_config_problem(p.config) == ""
            # past d128 the warpgroups share 64 keys, dK and dV split by head-dim columns
            assert (p.config.tile_n, p.config.dkv_split) == ((128, "m") if d <= 128 else (64, "n"))
            # 128 query rows only where little per score needs registers: d <= 64, at most causal
            plain = mask in ({}, {"causal": True})
            assert (p.config.tile_m, p.config.dq_split) == ((128, "m") if d <= 64 and plain else (64, "n"))
            assert p.config.head_dim_padded % 16 == 0
            assert all(p.reasons.get(name) for name in type(p.config).model_fields), p.reasons
            assert Plan.model_validate_json(p.model_dump_json()) == p


@pytest.mark.parametrize(
    "fields,named",
    [
        (
            {
                "deterministic": True,
                "score_mod": {"kind": "relative_bias", "max_distance": 8, "requires_grad": True},
            },
            "deterministic: true with trainable tensors",
        ),
    ],
)
def test_backward_refuses_a_variant_it_has_no_kernel_for(fields, named):
    from fa4gen.planner import backward_plan, backward_problem

    spec = AttentionSpec(**{"head_dim": 128, **fields})
    assert named in backward_problem(spec)
    with pytest.raises(ValueError, match=named) as error:
        backward_plan(spec)
    assert "\n" not in str(error.value)


def test_backward_config_check_names_what_is_wrong():
    from fa4gen.kernels.sm90.bwd_config import bwd_config_problem
    from fa4gen.planner import backward_plan

    good = backward_plan(AttentionSpec(head_dim=128, causal=True)).config
    cases = {
        "dq_split m needs tile_m = 128": {"dq_split": "m"},
        "shared memory": {"tile_m": 128, "dq_split": "m", "head_dim_v": 256, "head_dim_v_padded": 256},
        "pool": {"consumer_regs": 256},
        "accumulators take": {"head_dim": 192, "head_dim_padded": 192, "dq_stages": 1, "q_stages": 1},
        "2 consumer warpgroups": {"num_consumer_warpgroups": 3},
        "not a positive multiple of 16": {"tile_m": 72},
    }
    for needle, update in cases.items():
        problem = bwd_config_problem(good.model_copy(update=update))
        assert needle in problem, (update, problem)
    wide = backward_plan(AttentionSpec(head_dim=256, causal=True)).config
    assert "shared memory" in bwd_config_problem(wide.model_copy(update={"q_stages": 2}))
    one_tile = {"dkv_split": "m", "head_dim": 192, "head_dim_padded": 192, "head_dim_v": 128, "head_dim_v_padded": 128}
    assert "accumulators take" in bwd_config_problem(wide.model_copy(update=one_tile))
    d64 = {"tile_m": 128, "dq_split": "m", "head_dim": 64, "head_dim_padded": 64, "head_dim_v": 64}
    assert bwd_config_problem(good.model_copy(update={**d64, "head_dim_v_padded": 64})) == ""


def test_transposed_split_rules():
    """dkv_split t (96-key tiles at d192/128, dK^T and dV^T with keys on the MMA's N side): its
    tile, registers and shared memory as the check counts them, and each of its rules."""
    from fa4gen.kernels.sm90.bwd_config import bwd_accumulator_registers, bwd_config_problem, bwd_smem_bytes
    from fa4gen.planner import backward_plan

    wide = backward_plan(AttentionSpec(head_dim=192, head_dim_v=128, causal=True)).config
    t = wide.model_copy(update={"dkv_split": "t", "keys_per_warpgroup": 48})
    assert bwd_config_problem(t) == "" and t.tile_n == 96 and t.transposed and not wide.transposed
    # per thread: dK^T + dV^T 96 x 320 / 256 = 120, beside S and dP 2 x 64 x 96 / 256 = 48 (n: 80
    # beside dQ 64 x 192 / 256 = 48)
    assert bwd_accumulator_registers(t) == 120 + 48 and bwd_accumulator_registers(wide) == 80 + 48
    # K and V of 96 keys, two Q/dO stages, P and dS, dQ's fp32 staging and the rows' LSE and dPsum
    assert bwd_smem_bytes(t) - bwd_smem_bytes(wide) == (32 * 320 + 2 * 64 * 32) * 2
    cases = {
        "keys_per_warpgroup = 64": (wide, {"keys_per_warpgroup": 48}),
        "multiple of 8 up to 128": (t, {"keys_per_warpgroup": 44}),
        "head dims divisible by 64": (t, {"head_dim": 160, "head_dim_padded": 160}),
        "tile_m = 64 and dq_split n": (t, {"tile_m": 128, "dq_split": "m"}),
        "packed documents": (t, {"document": True}),
        "shared memory": (t, {"keys_per_warpgroup": 64}),
    }
    for needle, (config, update) in cases.items():
        problem = bwd_config_problem(config.model_copy(update=update))
        assert needle in problem, (update, problem)
    # 192/192 fits with one Q/dO stage
    square = backward_plan(AttentionSpec(head_dim=192)).config
    square_t = square.model_copy(update={"dkv_split": "t", "keys_per_warpgroup": 48})
    assert "shared memory" in bwd_config_problem(square_t)
    assert bwd_config_problem(square_t.model_copy(update={"q_stages": 1})) == ""


def test_a_backward_plan_has_no_first_call_plan_or_split_workspace():
    from fa4gen.planner import backward_plan, backward_workspace_shapes, first_call_plan

    p = backward_plan(AttentionSpec(head_dim=96, causal=True))
    assert first_call_plan(p) is None and split_workspace_shape(p, 132) is None
    shapes = backward_workspace_shapes(p, 3, 8, 1000)
    rows = {"dq_accum": (3, 8, 1024, 96), "dpsum": (3, 8, 1024), "lse_log2": (3, 8, 1024)}
    assert shapes == {**rows, "dq_order": (1, 1, 1, 2)}  # (a stand-in: dQ's sums in any order)
    ordered = backward_plan(AttentionSpec(head_dim=96, causal=True, deterministic=True))
    assert ordered.config.deterministic and "decision bwd-deterministic" in ordered.reasons["deterministic"]
    assert backward_workspace_shapes(ordered, 3, 8, 1000) == {**rows, "dq_order": (3, 8, 16, 2)}
    # dQ groups: the accumulator's rows and the semaphores' query tiles repeat per group
    with pytest.raises(AssertionError, match="dq_grouped_turns"):
        backward_workspace_shapes(ordered, 3, 8, 1000, 2)
    grouped = ordered.with_config("a test", dq_grouped_turns=True)
    assert backward_workspace_shapes(grouped, 3, 8, 1000, 3) == {
        **rows,
        "dq_accum": (3, 8, 3072, 96),
        "dq_order": (3, 8, 48, 2),
    }


def test_a_deterministic_backward_deals_its_dq_turns_over_groups_by_key_tiles():
    """backward.dq_groups: one group per KEY_TILES_PER_DQ_GROUP key tiles, at most MAX_DQ_GROUPS,
    and one without dq_grouped_turns (the planner leaves it off until it is measured on a GPU;
    bwd_config_problem refuses it without deterministic mode)."""
    from fa4gen.backward import KEY_TILES_PER_DQ_GROUP, MAX_DQ_GROUPS, dq_groups
    from fa4gen.kernels.sm90.bwd_config import bwd_config_problem
    from fa4gen.planner import backward_plan

    plain = backward_plan(AttentionSpec(head_dim=128, causal=True))
    planned = backward_plan(AttentionSpec(head_dim=128, causal=True, deterministic=True))
    assert not planned.config.dq_grouped_turns and dq_groups(planned, 1 << 20) == 1
    grouped = {"dq_grouped_turns": True}
    assert "needs deterministic" in bwd_config_problem(plain.config.model_copy(update=grouped))
    ordered = planned.with_config("a test", **grouped)
    assert bwd_config_problem(ordered.config) == ""
    tile_n = ordered.config.tile_n
    assert dq_groups(plain, 1 << 20) == 1
    assert dq_groups(ordered, 1) == 1
    assert dq_groups(ordered, tile_n * KEY_TILES_PER_DQ_GROUP * 2) == min(2, MAX_DQ_GROUPS)
    assert dq_groups(ordered, 1 << 20) == MAX_DQ_GROUPS


def test_a_deterministic_backward_takes_its_dq_turns_on_the_writer_warp():
    """Its waits for turns and for sums to land would otherwise stall a consumer warpgroup's MMAs:
    the planner gives it the dQ writer warp, and the one feasibility check refuses one without."""
    from fa4gen.kernels.sm90.bwd_config import bwd_config_problem
    from fa4gen.planner import backward_plan

    for spec in (AttentionSpec(head_dim=96), AttentionSpec(head_dim=256, causal=True)):
        plain, ordered = backward_plan(spec), backward_plan(spec.model_copy(update={"deterministic": True}))
        assert not plain.config.dq_writer and ordered.config.dq_writer
        assert "stall no MMA" in ordered.reasons["dq_writer"]
        assert not bwd_config_problem(plain.config.model_copy(update={"dq_writer": True}))  # an A/B option
        refused = bwd_config_problem(ordered.config.model_copy(update={"dq_writer": False}))
        assert "dq_writer" in refused


def test_a_kv_heads_query_heads_split_over_two_ctas_only_where_masked_ctas_would_leave_sms_idle():
    from fa4gen.backward import head_splits
    from fa4gen.planner import backward_plan

    gqa8 = backward_plan(AttentionSpec(head_dim=128, qhead_per_kvhead=8, causal=True))
    assert head_splits(gqa8, 4, 2, 4096, 132) == 2  # 32 key tiles x 2 KV heads x 4 = 256 CTAs < 4 x 132
    assert head_splits(gqa8, 8, 2, 4096, 132) == 2  # 512 CTAs
    assert head_splits(gqa8, 16, 2, 4096, 132) == 1  # 1024 CTAs
    dense = backward_plan(AttentionSpec(head_dim=128, qhead_per_kvhead=8))
    assert head_splits(dense, 4, 2, 4096, 132) == 1  # equal CTAs: splitting only adds the sums
    mha = backward_plan(AttentionSpec(head_dim=128, causal=True))
    assert head_splits(mha, 1, 1, 128, 132) == 1  # one query head per KV head: nothing to split
    documents = backward_plan(AttentionSpec(head_dim=128, qhead_per_kvhead=2, mask="document"))
    assert documents.config.document and head_splits(documents, 1, 2, 4096, 132) == 2  # unequal documents
    odd = backward_plan(AttentionSpec(head_dim=64, qhead_per_kvhead=5))
    assert head_splits(odd, 1, 1, 128, 132) == 1  # (two partials only: an odd group stays whole)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_workspaces_have_the_static_extents_the_kernel_was_traced_with(deterministic):
    """The runtime allocates the workspaces by backward_workspace_shapes; the kernel checks each
    one's static extents (head dims, the semaphores' warpgroups) against its traced stand-ins."""
    from fa4gen.api import training_spec
    from fa4gen.compiler import fake_backward_arguments
    from fa4gen.planner import backward_plan, backward_workspace_shapes

    spec = training_spec(AttentionSpec(head_dim=96, causal=True, deterministic=deterministic))
    p = backward_plan(spec)
    traced = fake_backward_arguments(spec, p)[10:14]  # dq_accum, dpsum, lse_log2, dq_order
    shapes = backward_workspace_shapes(p, 3, 8, 1000)
    for name, fake in zip(("dq_accum", "dpsum", "lse_log2", "dq_order"), traced, strict=True):
        assert len(fake.shape) == len(shapes[name]), name
        static = [(extent, want) for extent, want in zip(fake.shape, shapes[name]) if isinstance(extent, int)]
        assert all(extent == want for extent, want in static), (name, fake.shape, shapes[name])
    assert isinstance(traced[3].shape[3], int), "the semaphores' warpgroups are static"


def test_key_tiles_launch_heaviest_first_where_it_is_safe():
    """Deterministic with descending dQ turns (a right bound): heaviest first while one (batch,
    head)'s key tiles fit on the GPU at once, highest first past that (each CTA then waits only on
    CTAs launched before it); ascending turns never reverse. Without deterministic mode, a right
    bound with one to eight CTAs per SM launches key tile 0 of every (KV head, batch) first;
    nothing else changes the order."""
    from fa4gen.backward import key_tile_order
    from fa4gen.kernels.sm90.bwd_config import KeyTileOrder
    from fa4gen.planner import backward_plan

    natural, reversed_, outermost = (int(o) for o in KeyTileOrder)
    causal = backward_plan(AttentionSpec(head_dim=128, causal=True, deterministic=True))
    assert causal.config.dq_descending
    assert key_tile_order(causal, 4, 16, 128 * 132, 132) == natural  # 132 key tiles on 132 SMs
    assert key_tile_order(causal, 4, 16, 128 * 132 + 1, 132) == reversed_
    dense = backward_plan(AttentionSpec(head_dim=128, deterministic=True))
    assert not dense.config.dq_descending and key_tile_order(dense, 4, 16, 1 << 20, 132) == natural
    free = backward_plan(AttentionSpec(head_dim=128, causal=True, qhead_per_kvhead=8))
    assert key_tile_order(free, 4, 4, 4096, 132) == outermost  # 32 key tiles x 16 CTAs: 512
    assert key_tile_order(free, 1, 4, 4096, 132) == natural  # 128 CTAs: one wave
    assert key_tile_order(free, 4, 16, 4096, 132) == natural  # 2048 CTAs: short ones, L2 first
    assert key_tile_order(free, 4, 8, 4096, 132) == outermost  # 1024 <= 8 per SM
    window = backward_plan(AttentionSpec(head_dim=128, window_left=256, window_right=256))
    assert key_tile_order(window, 4, 8, 4096, 132) == outermost
    for spec in (AttentionSpec(head_dim=128), AttentionSpec(head_dim=128, window_left=256)):
        assert key_tile_order(backward_plan(spec), 4, 16, 1 << 20, 132) == natural
