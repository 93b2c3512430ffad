"""Drafter families: the one table (:mod:`~eagleflow.drafters.registry`) and each family's own folder.

- :mod:`~eagleflow.drafters.registry`: :data:`FAMILIES`, :func:`family` — what the stages and the run ask;
- :mod:`~eagleflow.drafters.plan`: several drafters from one capture (the ``drafters`` Param), and where
  each drafter's layers sit in a sample captured for all of them;
- ``eagle3/``: EAGLE-3 and EAGLE-3.1 (chains and trees of one-token steps);
- ``dflash/``: DFlash (one pass drafts a block);
- ``dspark/``: DSpark (DFlash's block with a Markov head and a confidence head, built on ``dflash/``).

The table and the plan are light and sit below the stages (the Params form and the DAG file read them);
a family's folder sits above the stages whose machinery it uses, reached only through the table's owners
(``docs/design.md`` §2).
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "registry": [
            "FAMILIES", "FAMILY_SETTINGS", "NOT_OFFERED", "STAGES", "DraftAlgorithm", "DrafterFamily", "check_family_settings", "family",
            "family_of_algorithm", "family_of_checkpoint",
        ],
        "plan": ["DRAFTER_SETTINGS", "FAMILY_SHAPED", "drafter_plan", "slots_of", "union_of_layers"],
    },
)
