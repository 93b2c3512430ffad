"""eagleflow core: every step of the pipeline, runnable as ``python -m eagleflow <step>``.

Nothing here imports Airflow; the heavy libraries (torch, transformers, speculators) are
imported inside the functions that use them so ``import eagleflow`` stays cheap.
"""

__version__ = "0.1.0"
