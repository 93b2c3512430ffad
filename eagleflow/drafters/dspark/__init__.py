"""DSpark: a DFlash block drafter with a Markov head and a confidence head (DeepSeek, arXiv 2607.05147).

Everything that is DSpark's own, in one folder (built on :mod:`eagleflow.drafters.dflash`, as speculators'
``DSparkDraftModel`` and SGLang's ``DSparkDraftModel`` are built on their DFlash classes).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {})
