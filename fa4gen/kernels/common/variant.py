"""The variant's run-time values inside a kernel: one tuple argument, unpacked by name.

The emitted module knows which extras a variant takes (fa4gen.variants.lower lists them: sink
logits, prefix lengths, document key ranges, ALiBi slopes, bias tables, aux tensors and scalars); the
kernel receives them as one tuple and reads them as attributes, e.g. ``args.sinks[head]``.
"""

from __future__ import annotations


class VariantArgs:
    """A plain holder made once per kernel launch at trace time (never assigned inside a loop)."""

    def __init__(self, names: tuple, values: tuple):
        assert len(names) == len(values), f"kernel expects extras {names}, got {len(values)} values"
        self.names = tuple(names)
        for name, value in zip(names, values):
            setattr(self, name, value)


def add_at(tensor, coords: tuple, value) -> None:
    """Atomically add fp32 ``value`` into ``tensor`` at ``coords`` (a gradient summed over many
    threads and CTAs, in no fixed order)."""
    import cutlass.cute as cute
    from cutlass import Float32

    target = tensor.iterator + cute.crd2idx(coords, tensor.layout)
    cute.arch.red(target, Float32(value), op="add", dtype="f32", sem="relaxed", scope="gpu")
