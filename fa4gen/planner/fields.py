"""The config fields a spec fixes, shared by the sm_90a planners (forward and decode): one place
for how a spec's variant becomes kernel constants."""

from __future__ import annotations

import math

from fa4gen.spec import AttentionSpec
from fa4gen.variants import lower

LOG2E = math.log2(math.e)


def variant_fields(spec: AttentionSpec) -> dict:
    """The config fields the spec fixes (the kernel reads them as they are)."""
    lowered = lower(spec)
    modified = lowered.score is not None or spec.softcap is not None
    return dict(
        head_dim=spec.head_dim,
        head_dim_v=spec.dv,
        qhead_per_kvhead=spec.qhead_per_kvhead,
        # scores leave score_mod in natural-log units: exp2 then needs only log2(e)
        scale_log2=LOG2E if modified else spec.scale * LOG2E,
        window_left=spec.left_bound,
        window_right=spec.right_bound,
        chunk=spec.mask.size if spec.mask_kind == "chunked" else None,
        prefix_lm=spec.mask_kind == "prefix_lm",
        document=spec.is_varlen,
        expression_mask=lowered.mask is not None,
        sinks=spec.sinks,
        return_lse=spec.return_lse,
        extra_names=tuple(extra.name for extra in lowered.extras),
    )
