"""Several drafters from one capture: the ``drafters`` Param, each drafter's name and own settings.

A run that lists drafters (``["eagle3", {"name": "dflash-b8", "draft_algorithm": "dflash",
"block_size": 8}]``) captures the union of the layers they read once, then trains, exports and
measures each one as its own mapped task instance, named by the drafter. What may differ between
drafters is what makes them different drafters (:data:`DRAFTER_SETTINGS`); what makes their
comparison fair stays run-wide: the data and its split, the prompt sets, rounds and harness of
the evaluation, the training nodes and where the hidden states come from.

The plan (:func:`drafter_plan`) is the XCom the DAG maps over: ``[{name, folder, settings}]``,
``folder`` None for a run without the Param (its one drafter keeps the run folder's own
``train/``, ``drafter/``, ``eval/``, as every run made before the Param).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagleflow.errors import excerpt_repr
from eagleflow.layout import check_run_name

# What a drafter may set for itself; every other Param is the run's, the same for all of its drafters.
DRAFTER_SETTINGS: tuple[str, ...] = (
    "draft_algorithm", "num_layers", "block_size", "mask_token_id", "max_anchors", "draft_vocab_size", "draft_config",
    "ttt_steps", "lr", "epochs", "noise_std", "scheduler_type", "scheduler_warmup_ratio", "serve_with", "eval_configs",
    "aux_layer_ids", "markov_rank", "markov_head_type",
)
# Settings whose meaning is a family's (a chain's TTT steps and reduced vocabulary, a block's size, mask token and
# anchors, DSpark's Markov head, the draft's depth, the serving configs its shape can take): the run's values are its draft_algorithm's;
# a drafter of another family takes its own family's defaults unless its entry sets them, so an entry naming only
# its family works beside the run's (``["eagle3", "dflash"]``).
FAMILY_SHAPED: tuple[str, ...] = (
    "draft_vocab_size", "eval_configs", "num_layers", "block_size", "mask_token_id", "max_anchors", "ttt_steps",
    "markov_rank", "markov_head_type",
)
PARAM = "Param drafters"


def drafter_plan(entries: Sequence[Any], default_algorithm: str) -> list[dict[str, Any]]:
    """The run's drafters, ``[{name, folder, settings}]``, from the ``drafters`` Param (``entries``).

    An entry is a family name (``"dflash"``) or an object of :data:`DRAFTER_SETTINGS` with an
    optional ``name`` (default: its ``draft_algorithm``). No entry: the run's one drafter, named
    by ``default_algorithm`` and kept in the run folder. Raises ValueError naming the entry.
    """
    if not entries:
        return [{"name": default_algorithm, "folder": None, "settings": {}}]
    plan: list[dict[str, Any]] = []
    for index, entry in enumerate(entries):
        where = f"{PARAM} entry {index}"
        if isinstance(entry, str):
            entry = {"draft_algorithm": entry}
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is {excerpt_repr(entry)}: give a family name (\"dflash\") or an object of its settings")
        settings = {k: v for k, v in entry.items() if k != "name"}
        unknown = sorted(set(settings) - set(DRAFTER_SETTINGS))
        if unknown:
            raise ValueError(
                f"{where} sets {', '.join(unknown)}, which every drafter of a run shares (set it as the run's Param); "
                f"a drafter may set {', '.join(DRAFTER_SETTINGS)}"
            )
        name = entry.get("name") or settings.get("draft_algorithm") or default_algorithm
        if not isinstance(name, str):
            raise ValueError(f"{where}: name {excerpt_repr(name)} is not a string")
        try:
            check_run_name(name)
        except ValueError as exc:
            raise ValueError(f"{where}: drafter name {str(exc).removeprefix('run name ')}") from exc
        if any(d["name"] == name for d in plan):
            raise ValueError(f"{where}: two drafters are named {name!r}; give each its own \"name\"")
        plan.append({"name": name, "folder": name, "settings": settings})
    return plan


def union_of_layers(per_drafter: Sequence[Sequence[int]]) -> list[int]:
    """The aux layer ids a capture for all of ``per_drafter`` holds: each drafter's, once, in order."""
    return sorted({layer for layers in per_drafter for layer in layers})


def slots_of(aux_layer_ids: Sequence[int], captured: Sequence[int]) -> list[int]:
    """Where a drafter's aux layers sit in a sample captured for ``captured`` (its last slot: the final state).

    A sample holds ``len(captured) + 1`` slots: the captured layers' input states in order, then
    the final pre-norm state; a drafter reads its own layers' slots and the final one.
    """
    missing = [k for k in aux_layer_ids if k not in captured]
    if missing:
        raise ValueError(f"aux layer ids {missing} were not captured (the capture holds {list(captured)})")
    return [list(captured).index(k) for k in aux_layer_ids] + [len(captured)]
