"""Register-fragment views shared by the attention kernels.

A Hopper warpgroup MMA leaves each thread a C fragment of shape ((2, 2, N/8), MMA_M, MMA_N):
mode 0 holds (column pair, row +8, column group of 8). Softmax wants the same registers as a
(rows, columns) matrix, and the P.V product wants the probabilities as an A-operand fragment.
Both are pure re-viewings of the same registers; nothing here moves data.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


def acc_rows_cols(layout: cute.Layout) -> cute.Layout:
    """View a wgmma C-fragment layout ((2, 2, V), M, N) as ((2, M), (2, V, N)): rows x columns."""
    shape, stride = layout.shape, layout.stride
    (v_col, v_row, v_grp), m, n = shape[0], shape[1], shape[2]
    (s_col, s_row, s_grp), sm, sn = stride[0], stride[1], stride[2]
    return cute.make_layout(
        ((v_row, m), (v_col, v_grp, n)),
        stride=((s_row, sm), (s_col, s_grp, sn)),
    )


def rows_cols_view(tensor: cute.Tensor) -> cute.Tensor:
    return cute.make_tensor(tensor.iterator, acc_rows_cols(tensor.layout))


@cute.jit
def convert_into(src: cute.Tensor, dst: cute.Tensor):
    """dst[i] = src[i] rounded to dst's type, element by element.

    Element-wise on purpose: converting a whole fragment as one vector value (``.load().to()``)
    materialises it and spilled 128-register O fragments at d=256."""
    for i in cutlass.range_constexpr(cute.size(src)):
        dst[i] = src[i].to(dst.element_type)


@cute.jit
def store_as_operand_a(acc: cute.Tensor, operand: cute.Tensor):
    """Round an fp32 C fragment into ``operand``, the A-operand fragment of the next wgmma.

    For 16-bit types the C fragment of an (M, N) product and the A fragment of an (M, K=N)
    product enumerate their registers in the same order, so conversion is element-wise.
    """
    convert_into(acc, cute.make_tensor(operand.iterator, acc.layout))
