"""Exceptions that carry what went wrong as fields, so callers branch on data, not on text."""

from __future__ import annotations


class UserError(Exception):
    """Bad input a user can fix: a flag, a file, a row. ``python -m eagleflow`` exits 2 on it."""
