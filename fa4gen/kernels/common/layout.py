"""Register-fragment views shared by the attention kernels.

A Hopper warpgroup MMA leaves each thread a C fragment of shape ((2, 2, N/8), MMA_M, MMA_N):
mode 0 holds (column pair, row +8, column group of 8). Softmax wants the same registers as a
(rows, columns) matrix, and the P.V product wants the probabilities as an A-operand fragment.
Both are pure re-viewings of the same registers; nothing here moves data.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float16, Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

PTX_PAIR_TYPES = {BFloat16: "bf16x2", Float16: "f16x2"}


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


@dsl_user_op
def pack_pair_pinned(low, high, pair_type: str, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded into one 32-bit word of two 16-bit values (``low`` in bits 0-15),
    by one ``cvt.rn.{pair_type}.f32`` that LLVM keeps where it is traced (a volatile asm).

    Why pinned: the probabilities' conversions are used only after the O-rescale branch, and
    LLVM's machine sinking moves plain conversions below it, out of the basic block of the
    exponentials, so ptxas ran them after the last exponential instead of between them.

    Rounding bf16 pairs with integer ALU instructions instead measured slower (decision
    pinned-p-conversions)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(high).ir_value(loc=loc, ip=ip), Float32(low).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{pair_type}.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_pinned(src: cute.Tensor, dst: cute.Tensor):
    """``convert_into`` for compact fp32 ``src`` and compact 16-bit ``dst`` of the same shape,
    in pairs pinned where the call is traced (see pack_pair_pinned)."""
    pair_type = PTX_PAIR_TYPES[dst.element_type]
    words = cute.make_tensor(cute.recast_ptr(dst.iterator, dtype=Int32), cute.make_layout(cute.size(src) // 2))
    for i in cutlass.range_constexpr(cute.size(src) // 2):
        words[i] = pack_pair_pinned(src[2 * i], src[2 * i + 1], pair_type)


@cute.jit
def convert_p(src: cute.Tensor, dst: cute.Tensor, pinned: bool):
    """``convert_pinned`` where ``pinned``, else ``convert_into`` (LLVM may move those)."""
    if cutlass.const_expr(pinned):
        convert_pinned(src, dst)
    else:
        convert_into(src, dst)


@cute.jit
def store_as_operand_a(acc: cute.Tensor, operand: cute.Tensor, pinned: bool = True):
    """Round an fp32 C fragment into ``operand``, the A-operand fragment of the next wgmma
    (``pinned``: conversions pinned where this is called, see pack_pair_pinned).

    For 16-bit types the C fragment of an (M, N) product and the A fragment of an (M, K=N)
    product enumerate their registers in the same order, so conversion is element-wise.
    """
    convert_p(acc, cute.make_tensor(operand.iterator, acc.layout), pinned)
