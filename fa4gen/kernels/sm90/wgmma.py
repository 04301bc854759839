"""One warpgroup MMA product issued as a wgmma group, shared by the Hopper forward and decode steps."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import warpgroup


@cute.jit
def issue_k_blocks(first: cute.TiledMma, rest: cute.TiledMma, acc, a, b, stage: Int32):
    """acc (+)= a . b over a's K blocks with b's ring stage ``stage``, committed as one group:
    ``first`` issues the first block (accumulate off where it starts a product), ``rest`` the
    others. Returns at once; warpgroup.wait_group waits for it."""
    for kb in cutlass.range_constexpr(cute.size(a, mode=[2])):
        cute.gemm(first if kb == 0 else rest, acc, a[None, None, kb], b[None, None, kb, stage], acc)
    warpgroup.commit_group()
