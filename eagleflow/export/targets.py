"""What each serving engine needs from an EAGLE-3 drafter: the one place that says it.

Training reads it to train the function the engine will compute; the export reads it to refuse
a checkpoint the engine would serve as a different function.

- **SGLang** (``sglang/srt/models/llama_eagle3.py``, 0.5.20–0.5.23): the first draft layer keeps
  the *pre-norm* target state as its residual (``residual = hidden_states; hidden_states =
  self.hidden_norm(hidden_states)``) and nothing reads ``norm_before_residual``. A drafter
  trained with ``norm_before_residual`` True (speculators' CLI default) and served by SGLang
  computes something else than it was trained as.
- **vLLM** loads speculators' own format and reads ``norm_before_residual`` from it, so
  either value is served as trained; speculators' default is kept.

The draft variant (:data:`DRAFT_VARIANTS`) decides how the aux states enter ``fc`` and what a
draft step hands the next: ``eagle3`` one RMSNorm over the concatenated aux states
(``norm_before_fc``), ``eagle3.1`` one RMSNorm per aux state (``fc_norm``, the EAGLE-3.1 paper's);
both feed the next step the normed state (``norm_output``). speculators trains both (0.8.1 and
0.9.0 have ``--fc-norm``); SGLang serves ``fc_norm`` and ``norm_output`` from 0.5.13, ``norm_before_fc``
from 0.5.17 (:data:`eagleflow.export.sglang_drafter.SINCE`), where ``llama_eagle3.py`` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

ServeWith = Literal["sglang", "vllm"]
# The serving engine as training and export both declare it: one Param sets both.
ServingEngine = Annotated[
    ServeWith,
    Field(
        "sglang",
        title="Serving engine",
        description="the engine that will serve the drafter: sglang trains with norm_before_residual off (what SGLang's "
        "draft layer computes) and requires the SGLang export; vllm keeps speculators' default and needs only the "
        "speculators folder",
    ),
]
DraftVariant = Literal["eagle3", "eagle3.1"]
# speculators train flags of each draft variant (speculators' EAGLE-3 defaults, said explicitly for eagle3).
DRAFT_VARIANTS: dict[str, tuple[str, ...]] = {
    "eagle3": ("--norm-before-fc", "--norm-output"),
    "eagle3.1": ("--fc-norm", "--no-norm-before-fc", "--norm-output"),
}


@dataclass(frozen=True)
class ServingTarget:
    """How a drafter must be trained and exported for one serving engine."""

    name: ServeWith
    norm_before_residual: bool
    why: str


SERVING_TARGETS: dict[str, ServingTarget] = {
    "sglang": ServingTarget(
        "sglang",
        norm_before_residual=False,
        why="SGLang's EAGLE-3 draft layer keeps the pre-norm target state as its residual and ignores "
        "norm_before_residual, so the drafter is trained that way",
    ),
    "vllm": ServingTarget(
        "vllm",
        norm_before_residual=True,
        why="vLLM reads norm_before_residual from speculators' checkpoint, so speculators' default is kept",
    ),
}


def serving_target(name: str) -> ServingTarget:
    """The :class:`ServingTarget` called ``name`` (``sglang`` or ``vllm``)."""
    try:
        return SERVING_TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown serving engine {name!r}; expected one of {sorted(SERVING_TARGETS)}") from None
