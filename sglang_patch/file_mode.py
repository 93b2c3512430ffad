"""The mode of a published file (standard library only, so light importers can share it)."""

from __future__ import annotations

import os


def published_file_mode() -> int:
    """The mode ``open()`` gives a new file under the current umask (usually 0644).

    Atomic writes start from ``mkstemp``, which makes files owner-only; what they publish must
    be readable by the other processes of the pipeline (extractor, trainer, web server).
    """
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask
