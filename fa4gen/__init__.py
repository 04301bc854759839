"""fa4gen: a JIT kernel-generation compiler for attention variants."""

__version__ = "0.1.0"
