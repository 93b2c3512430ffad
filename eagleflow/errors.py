"""Exceptions that carry what went wrong as fields, so callers branch on data, not on text."""

from __future__ import annotations


class UserError(Exception):
    """Bad input a user can fix: a flag, a file, a row. ``python -m eagleflow`` exits 2 on it."""


EXCERPT_CHARS = 200


def excerpt(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``str(value)`` cut to at most ``limit`` characters, saying how much was left out.

    Error messages quote input through this, so one huge field or row never becomes a
    megabyte-long message (or log line, or HTTP body).
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text) - limit} more characters)"


def excerpt_repr(value: object, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` bounded like :func:`excerpt`, without building the whole repr of a huge container."""
    if isinstance(value, (list, tuple, dict)) and len(value) > limit:
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]!r}… ({len(value) - limit} more characters)"
    return excerpt(repr(value), limit)


def param_text(name: str, label: str | None) -> str:
    """How a message names a Param: its name and its label in the trigger form, ``Param eval_configs ("Serving
    configs to sweep")`` (the name alone when it has no label)."""
    return f'Param {name} ("{label}")' if label else f"Param {name}"
