"""The package version, in a module of its own so that modules inside fa4gen can read it
without importing the package (no import cycle)."""

__version__ = "0.1.0"
