"""Which hidden states a run captures: the one rule for aux layer ids (docs/design.md §3.1).

Layer id k is the residual-stream state entering decoder layer k; id n (the model's layer
count) is the last layer's output before the final norm, which every sample also carries as
its final slot. Every place that takes aux ids (the Params form, each step's flags, the
reference engine, the SGLang hook, training) checks them with :func:`validate_aux_layer_ids`,
so a list one of them accepts is accepted by all. Standard library only: the hook imports
this inside the SGLang server.
"""

from __future__ import annotations

from collections.abc import Sequence


def validate_aux_layer_ids(aux_layer_ids: Sequence[int], num_layers: int | None = None) -> list[int]:
    """``aux_layer_ids`` as a list of ints, order kept, after checking them.

    They must be non-empty, distinct and non-negative; with ``num_layers`` known, each must
    also be at most ``num_layers``. Two equal ids would give two identical slots, and
    speculators maps each id to one slot, so a repeated id is refused, not collapsed.

    :raises ValueError: naming the offending ids and the allowed range.
    """
    ids = [int(k) for k in aux_layer_ids]
    if not ids:
        raise ValueError("no aux layer ids: name at least one layer id to capture, e.g. 3,31,59")
    repeated = sorted({k for k in ids if ids.count(k) > 1})
    if repeated:
        raise ValueError(f"aux layer ids {ids} repeat {repeated}: each id is one slot, give each once")
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"the model must have at least one layer, got {num_layers}")
    bad = [k for k in ids if k < 0 or (num_layers is not None and k > num_layers)]
    if bad:
        where = f"0..{num_layers} for a model with {num_layers} decoder layers" if num_layers is not None else "0 or more"
        raise ValueError(
            f"aux layer ids {bad} are outside {where} (id k = the state entering layer k; "
            "id n = the last layer's output before the final norm)"
        )
    return ids


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """speculators' default target layer ids ``[2, n//2, n-3]`` (speculators/models/utils.py)."""
    return [2, num_layers // 2, num_layers - 3]
