"""The one error type of the benchmark."""

from __future__ import annotations


class BenchError(Exception):
    """The benchmark cannot run; the message is one line that says why (and what to do)."""
