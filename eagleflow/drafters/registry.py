"""The drafter families eagleflow trains, exports, serves and measures: one table, one entry per family.

Modelled on speculators (``@SpeculatorModelConfig.register("dflash")``; its trainer looks the family
up by ``--speculator-type``) and SGLang (``SpeculativeAlgorithm`` → ``create_worker``): what differs
between families lives in the family's own folder, ``eagleflow/drafters/<family>/``, and the stages
(training, export, the reference engine, evaluation) ask this table instead of branching on a family's
name. An entry names its owners as ``"module:attribute"`` strings, imported when first used, so reading
the table (the Params form, the DAG file) costs no torch, and the stages, below the families in
``docs/design.md`` §2, never import one (``tests/test_package_architecture.py`` imports every owner named
here and checks it lives in its family's folder):

- ``check``: what SGLang would refuse of the family's settings for a verifier, checked by the run's first task;
- ``train``: the family's speculators ``train`` flags;
- ``export``: its SGLang folder, and ``checkpoint``: what its speculators checkpoint holds;
- ``serving``: its SGLang serving flags;
- ``reference``: the reference engine's decoder for ``(model, ReferenceEngineConfig)``, SGLang's
  semantics on CPU.

Adding a family (README: "Adding a drafter family"): one folder, and one entry here.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

DraftAlgorithm = Literal["eagle3", "eagle3.1", "dflash", "dspark"]


# What a family owns, each named by a "module:attribute" string of its entry.
Stage = Literal["check", "train", "export", "checkpoint", "serving", "reference", "calibration"]
STAGES: tuple[Stage, ...] = ("check", "train", "export", "checkpoint", "serving", "reference")


@dataclass(frozen=True)
class DrafterFamily:
    """One family of drafters and the owners of what differs about it."""

    name: str  # the Param's value (draft_algorithm)
    speculator_type: str  # speculators train --speculator-type, and the checkpoint's speculators_model_type
    sglang_algorithm: str  # SGLang --speculative-algorithm
    block: bool  # one draft pass proposes a whole block, verified in one pass (its manifest's block_size: the tokens verified)
    minimum_speculators: str  # the oldest release that trains it
    default_layers: int  # draft decoder layers when the run leaves them empty (speculators' own default)
    default_block_size: int | None  # block drafters: tokens per block when left empty (speculators' own default)
    check: str
    train: str
    export: str
    checkpoint: str
    serving: str
    reference: str
    # Training settings only this family takes (TrainConfig fields), with speculators' default for each: another
    # family refuses them, and a run that leaves one empty trains (and records, for a resume) this value.
    settings: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # What the evaluation fits on held-out prompts for SGLang to read, when the family has such a file ("" for none):
    # an object with ``env`` (where a serving engine records) and ``fit(recording, out, dataset) -> dict``.
    calibration: str = ""

    def owner(self, stage: Stage) -> Any:
        """The function that owns ``stage`` for this family, imported on first use."""
        module, _, attribute = getattr(self, stage).partition(":")
        return getattr(importlib.import_module(module), attribute)


_EAGLE3 = dict(
    speculator_type="eagle3", sglang_algorithm="EAGLE3", block=False, minimum_speculators="0.8.1",
    default_layers=1, default_block_size=None,
    check="eagleflow.drafters.eagle3.flags:check_settings", train="eagleflow.drafters.eagle3.flags:train_flags",
    export="eagleflow.drafters.eagle3.sglang_export:export_eagle3_sglang",
    checkpoint="eagleflow.drafters.eagle3.sglang_export:CHECKPOINT", serving="eagleflow.drafters.eagle3.flags:serving_flags",
    reference="eagleflow.drafters.eagle3.reference:speculative_decoder",
)
FAMILIES: dict[str, DrafterFamily] = {
    "eagle3": DrafterFamily("eagle3", **_EAGLE3),
    "eagle3.1": DrafterFamily("eagle3.1", **_EAGLE3),
    "dflash": DrafterFamily(
        # speculators 0.9.0's DFlash recipe (RFC speculators#979): 5 layers, block 16 (z-lab's drafts use 16 too).
        "dflash", speculator_type="dflash", sglang_algorithm="DFLASH", block=True, minimum_speculators="0.9.0",
        default_layers=5, default_block_size=16,
        check="eagleflow.drafters.dflash.flags:check_settings", train="eagleflow.drafters.dflash.flags:train_flags",
        export="eagleflow.drafters.dflash.sglang_export:export_dflash_sglang",
        checkpoint="eagleflow.drafters.dflash.sglang_export:CHECKPOINT", serving="eagleflow.drafters.dflash.flags:serving_flags",
        reference="eagleflow.drafters.dflash.reference:dflash_decoder",
    ),
    "dspark": DrafterFamily(
        # speculators 0.9.0's DSpark recipe (train/config/schema.py DSparkArgs, _DEFAULT_BLOCK_SIZE): 5 layers, a block
        # of 8 drafted tokens (SGLang's gamma; the anchor slot drafts too, so 9 are verified), a vanilla Markov head of
        # rank 256 and the confidence head.
        "dspark", speculator_type="dspark", sglang_algorithm="DSPARK", block=True, minimum_speculators="0.9.0",
        default_layers=5, default_block_size=8,
        check="eagleflow.drafters.dspark.flags:check_settings", train="eagleflow.drafters.dspark.flags:train_flags",
        export="eagleflow.drafters.dspark.sglang_export:export_dspark_sglang",
        checkpoint="eagleflow.drafters.dspark.sglang_export:CHECKPOINT", serving="eagleflow.drafters.dspark.flags:serving_flags",
        reference="eagleflow.drafters.dspark.reference:dspark_decoder",
        calibration="eagleflow.drafters.dspark.sts:CALIBRATION",
        settings={"markov_rank": 256, "markov_head_type": "vanilla"},
    ),
}
# Every family's own training settings (DrafterFamily.settings), checked against the family that is chosen.
FAMILY_SETTINGS: tuple[str, ...] = tuple(sorted({name for entry in FAMILIES.values() for name in entry.settings}))
# Families speculators trains and SGLang serves that eagleflow does not (yet) carry end to end, and why:
# a drafter eagleflow cannot prove SGLang serves as trained is not offered.
NOT_OFFERED: dict[str, str] = {
    "dflash2": "DFlash2's training objective is unpublished (speculators' own docs/user_guide/algorithms/dflash2.md says "
    "so, and calls SGLang's serving of it unvalidated). Its grouped convolutions see the same block states in training "
    "and serving, but with no published objective there is nothing to check a trained DFlash2 against, and the "
    "reference engine does not compute its convolutions and candidate selector (dflash_config conv_kernel_size, "
    "conv_group_size, selector_rank, selector_top_k): eagleflow cannot prove it served as trained. Use dflash or dspark",
}


def family(name: str) -> DrafterFamily:
    """The family called ``name`` (the Param's value); a family not offered is refused with its reason."""
    if name in FAMILIES:
        return FAMILIES[name]
    if name in NOT_OFFERED:
        raise ValueError(f"draft algorithm {name!r} is not offered: {NOT_OFFERED[name]}")
    raise ValueError(f"unknown draft algorithm {name!r}; expected one of {', '.join(FAMILIES)}")


def check_family_settings(
    name: str, block_size: int | None, draft_vocab_size: int | None = None, **settings: Any
) -> DrafterFamily:
    """The family ``name``, refusing settings that do not apply to it: a block size for a chain drafter, a draft
    vocabulary (``draft_vocab_size`` given) for a block drafter, which SGLang serves through the target's own head,
    another family's own setting (``settings``: :data:`FAMILY_SETTINGS` given, e.g. ``markov_rank``)."""
    chosen = family(name)
    for setting, value in settings.items():
        if value is not None and setting not in chosen.settings:
            owners = [entry.name for entry in FAMILIES.values() if setting in entry.settings]
            raise ValueError(f"{setting} {value} applies to {' and '.join(owners) or 'no'} drafters; leave it empty for {name}")
    if not chosen.block and block_size is not None:
        raise ValueError(f"block_size {block_size} applies to block drafters; {name} drafts one token per step (ttt_steps)")
    if chosen.block and draft_vocab_size is not None:
        raise ValueError(
            f"draft_vocab_size {draft_vocab_size}: draft_algorithm {name} trains the verifier's full vocabulary (SGLang "
            "serves a block drafter through the target's own head); leave the draft vocabulary size empty"
        )
    return chosen


def family_of_checkpoint(speculators_model_type: str, fc_norm: bool = False) -> DrafterFamily:
    """The family of a speculators checkpoint (its config's ``speculators_model_type``)."""
    if speculators_model_type == "eagle3":
        return FAMILIES["eagle3.1" if fc_norm else "eagle3"]
    for entry in FAMILIES.values():
        if entry.speculator_type == speculators_model_type:
            return entry
    if speculators_model_type in NOT_OFFERED:
        raise ValueError(f"a {speculators_model_type} checkpoint: {NOT_OFFERED[speculators_model_type]}")
    raise ValueError(f"speculators_model_type {speculators_model_type!r} is not a family eagleflow exports ({', '.join(FAMILIES)})")


def family_of_algorithm(sglang_algorithm: str) -> DrafterFamily:
    """The first family SGLang serves as ``--speculative-algorithm sglang_algorithm``."""
    for entry in FAMILIES.values():
        if entry.sglang_algorithm == sglang_algorithm.upper():
            return entry
    raise ValueError(f"--speculative-algorithm {sglang_algorithm}: eagleflow serves {sorted({f.sglang_algorithm for f in FAMILIES.values()})}")
