"""The package version, in the lowest layer so that every module that records it can import it."""

__version__ = "0.1.0"
