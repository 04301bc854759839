"""Target architectures: the one module that knows hardware numbers.

Every capability (shared memory per CTA, registers, what instructions exist) is read from here,
never written as a literal elsewhere. Detection of the current GPU happens only at run time in
the host process (never while tracing a kernel), so artifacts stay machine-independent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# Hopper warpgroup MMA (wgmma) facts the planner and the sm_90a kernels share
WARP_THREADS = 32
WARPGROUP_THREADS = 128  # 4 warps issue one wgmma together
WGMMA_M = 64  # rows of one warpgroup MMA: a consumer warpgroup owns this many query rows
MMA_K_GRANULE = 16  # K extent of one 16-bit wgmma; head dims are zero-padded (by TMA) to it


class Arch(str, enum.Enum):
    """Targets fa4gen knows. Only ``supported`` ones can be planned and compiled."""

    SM90A = "sm_90a"
    SM100A = "sm_100a"  # reserved: Blackwell kernels come later

    @classmethod
    def parse(cls, value: str | Arch) -> Arch:
        if isinstance(value, Arch):
            return value
        text = str(value).strip().lower()
        for arch in cls:
            if text in (arch.value, arch.value.removesuffix("a"), arch.value.replace("sm_", "sm")):
                return arch
        known = ", ".join(a.value for a in cls)
        raise ValueError(f"unknown arch {value!r}: known targets are {known}")

    @property
    def caps(self) -> ArchCaps:
        return _CAPS[self]

    @property
    def supported(self) -> bool:
        return self.caps.supported


@dataclass(frozen=True)
class ArchCaps:
    arch: str
    compute_capability: tuple[int, int]
    supported: bool
    smem_bytes_per_cta: int  # opt-in dynamic shared memory limit per block
    smem_bytes_per_sm: int  # what the CTAs resident on one SM share
    smem_reserved_per_cta: int  # what the driver keeps of that per resident CTA
    registers_per_sm: int
    max_regs_per_thread: int
    warpgroup_mma: bool
    tma: bool
    setmaxnreg: bool
    l2_bytes: int  # L2 cache: the K/V working set a tile order keeps resident
    note: str


_CAPS: dict[Arch, ArchCaps] = {
    Arch.SM90A: ArchCaps(
        arch="sm_90a",
        compute_capability=(9, 0),
        supported=True,
        smem_bytes_per_cta=227 * 1024,
        smem_bytes_per_sm=228 * 1024,
        smem_reserved_per_cta=1024,
        registers_per_sm=64 * 1024,
        max_regs_per_thread=255,
        warpgroup_mma=True,
        tma=True,
        setmaxnreg=True,
        l2_bytes=50 * 1024 * 1024,
        note="Hopper (H100/H200): TMA, wgmma, setmaxnreg",
    ),
    Arch.SM100A: ArchCaps(
        arch="sm_100a",
        compute_capability=(10, 0),
        supported=False,
        smem_bytes_per_cta=227 * 1024,
        smem_bytes_per_sm=228 * 1024,
        smem_reserved_per_cta=1024,
        registers_per_sm=64 * 1024,
        max_regs_per_thread=255,
        warpgroup_mma=False,
        tma=True,
        setmaxnreg=True,
        l2_bytes=126 * 1024 * 1024,
        note="Blackwell (B200): reserved, kernels not written yet",
    ),
}


class UnsupportedArchError(RuntimeError):
    pass


def require_supported(arch: Arch | str) -> Arch:
    arch = Arch.parse(arch)
    if not arch.supported:
        ok = ", ".join(a.value for a in Arch if a.supported)
        raise UnsupportedArchError(f"arch {arch.value} is reserved but has no kernels yet; supported: {ok}")
    return arch


def arch_for_capability(major: int, minor: int) -> Arch:
    """Map a device's compute capability to the target fa4gen compiles for it."""
    for arch, caps in _CAPS.items():
        if caps.compute_capability == (major, minor):
            return require_supported(arch)
    ok = ", ".join(
        f"{a.value} (compute capability {a.caps.compute_capability[0]}.{a.caps.compute_capability[1]})"
        for a in Arch
        if a.supported
    )
    raise UnsupportedArchError(
        f"this GPU has compute capability {major}.{minor}, which fa4gen has no kernels for; supported: {ok}"
    )


def detect_arch(device: int | None = None) -> Arch:
    """The target for the current CUDA device (host-side query; never called while tracing)."""
    import torch

    if not torch.cuda.is_available():
        raise UnsupportedArchError(
            "no CUDA GPU is visible: pass arch='sm_90a' (or --arch) to cross-compile without one"
        )
    major, minor = torch.cuda.get_device_capability(device)
    return arch_for_capability(major, minor)
