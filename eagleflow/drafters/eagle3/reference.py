"""The reference engine's EAGLE-3 decoder for an exported SGLang folder: a chain, or a tree with topk > 1."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagleflow.drafters.eagle3.chain import ChainDecoder
from eagleflow.drafters.eagle3.draft_model import Eagle3Drafter
from eagleflow.drafters.eagle3.sglang_export import captured_layer_ids
from eagleflow.drafters.eagle3.tree import TreeDecoder
from eagleflow.errors import UserError
from eagleflow.export import NotServable

if TYPE_CHECKING:  # pydantic stays out of the decoder itself: benchmarks/gpu_check.py runs it on a bare GPU machine
    from eagleflow.engine import ReferenceEngineConfig


def speculative_decoder(model: Any, config: ReferenceEngineConfig) -> Any:
    """The EAGLE-3 decoder of ``--speculative-draft-model-path`` for ``model``, capturing what SGLang's target would."""
    return load_speculative_decoder(
        model, config.speculative_draft_model_path, config.speculative_num_steps, config.speculative_draft_window_size,
        topk=config.speculative_eagle_topk, num_draft_tokens=config.speculative_num_draft_tokens,
    )


def load_speculative_decoder(
    model: Any, folder: Path | None, num_steps: int, window: int | None, topk: int = 1, num_draft_tokens: int | None = None
) -> ChainDecoder:
    """The EAGLE-3 decoder of the exported SGLang drafter ``folder`` for ``model`` (flags as SGLang's):
    a chain with ``topk`` 1, else a tree of ``num_draft_tokens`` (:mod:`eagleflow.drafters.eagle3.tree`)."""
    from eagleflow.engine import AuxStateCapture

    if folder is None or not (Path(folder) / "config.json").is_file():
        raise UserError(f"--speculative-draft-model-path: {folder} has no config.json (run eagleflow export first)")
    drafter = Eagle3Drafter(Path(folder), model.get_input_embeddings(), model.dtype, next(model.parameters()).device)
    drafter.window = window
    architecture = (getattr(model.config, "architectures", None) or ["?"])[0]
    try:
        layers = captured_layer_ids(drafter.config["eagle_config"]["eagle_aux_hidden_state_layer_ids"], architecture)
    except NotServable as exc:
        raise UserError(f"--speculative-draft-model-path: {exc}") from exc
    capture = lambda: AuxStateCapture(model, layers)  # noqa: E731
    if topk == 1:
        return ChainDecoder(model, drafter, capture, num_steps)
    return TreeDecoder(model, drafter, capture, num_steps, topk, int(num_draft_tokens or num_steps + 1))
