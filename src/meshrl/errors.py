"""Errors every layer may raise and the CLI turns into one line."""

from __future__ import annotations


class MissingDependency(ImportError):
    """An optional package a feature needs is not installed; the message says what to install. The CLI prints it
    in one line (exit code 2) instead of the traceback of the failed import."""
