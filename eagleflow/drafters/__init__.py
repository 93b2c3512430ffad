"""Drafter families: the one table (:mod:`~eagleflow.drafters.registry`) and each family's own module.

- :mod:`~eagleflow.drafters.registry`: :data:`FAMILIES`, :func:`family` — what the pipeline asks;
- :mod:`~eagleflow.drafters.eagle3`: EAGLE-3 and EAGLE-3.1 (chains and trees of one-token steps);
- :mod:`~eagleflow.drafters.dflash`: DFlash (one pass drafts a block);
- :mod:`~eagleflow.drafters.plan`: several drafters from one capture (the ``drafters`` Param), and
  :mod:`~eagleflow.drafters.run_params` its part of the run's config.

Light: the Params form and the DAG file read the table.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "registry": [
            "FAMILIES", "NOT_OFFERED", "DraftAlgorithm", "DrafterFamily", "check_family_settings", "family", "family_of_algorithm", "family_of_checkpoint",
        ],
        "plan": ["DRAFTER_SETTINGS", "drafter_plan", "slots_of", "union_of_layers"],
    },
)
