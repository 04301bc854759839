"""exp2 on the FMA units: FlashAttention-4's answer to the saturated exponential unit.

On Hopper the multi-function unit (MUFU) retires 16 ``ex2`` per clock per SM while the FMA and
integer pipes retire 128 operations each, so a softmax whose exponentials keep MUFU busy can move
part of them to a polynomial and finish sooner. For x <= 0 (softmax arguments are never
positive):

    x' = max(x, -127)                      so 2^x' stays a normal float
    j  = floor(x')                         by adding 1.5 * 2^23 rounded towards -inf: the integer
                                           lands in the low mantissa bits, with no conversion unit
    f  = x' - j                            in [0, 1)
    p  = 1 + f (c1 + f (c2 + f c3))        2^f in [1, 2), minimax relative error 9.5e-5
    2^x = bits(p) + (bits(j + 1.5 * 2^23) << 23)   j added to the exponent field

Nine FMA/ALU instructions instead of one MUFU instruction. The error is far below the bf16 /
fp16 rounding the probabilities go through before the P.V product.
"""

from __future__ import annotations

import struct

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

# 2^f ~ 1 + f (C1 + f (C2 + f C3)) on [0, 1): relative minimax fit (Lawson iterations over 20k
# points), max relative error 9.49e-5 in float32 arithmetic
EXP2_POLY = (0.6950705647468567, 0.227650985121727, 0.07714325934648514)
EXP2_POLY_MAX_REL_ERROR = 9.5e-5
_ROUND_MAGIC = 12582912.0  # 1.5 * 2^23: x + magic holds round(x) in its low mantissa bits
_LOWEST_EXPONENT = -127.0


def _ptx_f32(value: float) -> str:
    """A float32 immediate in PTX's exact hexadecimal form."""
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", value))[0]


_C1, _C2, _C3 = (_ptx_f32(c) for c in EXP2_POLY)
_MAGIC = _ptx_f32(_ROUND_MAGIC)

EXP2_POLY_PTX = f"""{{
.reg .f32 xc, j, fl, fr, p;
.reg .b32 jb, pb;
max.ftz.f32 xc, $1, {_ptx_f32(_LOWEST_EXPONENT)};
add.rm.ftz.f32 j, xc, {_MAGIC};
sub.ftz.f32 fl, j, {_MAGIC};
sub.ftz.f32 fr, xc, fl;
fma.rn.ftz.f32 p, fr, {_C3}, {_C2};
fma.rn.ftz.f32 p, p, fr, {_C1};
fma.rn.ftz.f32 p, p, fr, 0f3F800000;
mov.b32 jb, j;
shl.b32 jb, jb, 23;
mov.b32 pb, p;
add.s32 pb, pb, jb;
mov.b32 $0, pb;
}}"""


@dsl_user_op
def exp2_poly(x, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 0 on the FMA/ALU pipes (see the module docstring); 0 for x <= -127."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            EXP2_POLY_PTX,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def exp2_poly_reference(x):
    """The same arithmetic in float32 numpy: what tests compare the device code against."""
    import numpy as np

    xc = np.maximum(np.asarray(x, dtype=np.float32), np.float32(_LOWEST_EXPONENT))
    fl = np.floor(xc).astype(np.float32)
    fr = (xc - fl).astype(np.float32)
    c1, c2, c3 = (np.float32(c) for c in EXP2_POLY)
    p = (np.float32(1) + fr * (c1 + fr * (c2 + fr * c3))).astype(np.float32)
    bits = p.view(np.int32) + (fl.astype(np.int32) << 23)
    return bits.view(np.float32)
