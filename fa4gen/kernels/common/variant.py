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
