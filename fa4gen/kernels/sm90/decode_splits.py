"""How many CTAs share one decode query tile's keys (split-KV): the host's run-time choice.

The split count is a launch argument of the Hopper decode kernel (fa4gen.kernels.sm90.decode),
never a compile-time constant, so this module is host-only (fa4gen.toolchain.HOST_ONLY_MODULES):
retuning it changes no artifact and invalidates no cache.
"""

from __future__ import annotations

import math

from fa4gen.kernels.sm90.decode_config import MAX_SPLITS

UNSPLIT_FILL = 0.45  # a launch of this share of the slots in CTAs runs unsplit ...
LONG_RUN_TILES = 128  # ... unless each CTA's run has at least this many key tiles
PAGED_LONG_RUN_TILES = 32  # (paged: between the 16 measured unsplit-faster and the 64 split-faster)


def decode_splits(
    batch: int,
    kv_heads: int,
    seqlen_q: int,
    seqlen_k: int,
    qhead_per_kvhead: int,
    tile_m: int,
    tile_n: int,
    slots: int,
    paged: bool = False,
) -> int:
    """How many CTAs share the keys of one (batch, KV head, query tile): enough to fill the
    ``slots`` (the runtime passes the SM count: one CTA per SM measured faster than one per CTA
    slot, decision decode-kernel), no more than leaves each at least four key tiles (shorter
    runs pay more for their prologue, epilogue and partial than they save), and one where the
    launch already fills most slots, or half of them with runs shorter than LONG_RUN_TILES
    (PAGED_LONG_RUN_TILES over a paged cache): two splits then cost their partials and merge and
    gain little (one split beat two at 64 CTAs on 132 SMs in 6 of 7 contiguous cells of at most 64
    key tiles; paged, at 16 key tiles but not at 64, whose 16-key boxes keep fewer bytes in flight
    per CTA: decision decode-q-registers), while longer runs are bound by HBM, which half the SMs
    do not saturate."""
    tiles = math.ceil(seqlen_q * qhead_per_kvhead / tile_m)  # packed query tiles per KV head
    ctas = max(batch * kv_heads * tiles, 1)
    key_tiles = max(math.ceil(seqlen_k / tile_n), 1)
    long_run = PAGED_LONG_RUN_TILES if paged else LONG_RUN_TILES
    if ctas >= slots * 0.8 or (ctas >= slots * UNSPLIT_FILL and key_tiles < long_run):
        return 1
    return max(1, min(slots // ctas, key_tiles // 4, MAX_SPLITS))
