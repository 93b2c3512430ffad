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

The drafter families and their train flags are :mod:`eagleflow.drafters`'.
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
