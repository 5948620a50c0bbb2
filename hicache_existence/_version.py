"""The package version (kept apart so any module can read it without a cycle)."""

__version__ = "0.1.0"
