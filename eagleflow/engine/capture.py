"""Hidden-state capture from a ``transformers`` causal LM, by forward hooks (docs/design.md §3.1).

Slot ``i < len(aux_layer_ids)`` holds the residual-stream state *entering* decoder layer
``aux_layer_ids[i]`` (layer id ``n`` = the last layer's output before the final norm); the last
slot holds the final pre-norm state. Hooks read the layer inputs and the final norm's input, so
the model's own return value is untouched. ``output_hidden_states`` is not used: transformers
puts the *post*-norm state in its last entry, which is not what EAGLE-3 trains on.

The reference engine captures through :class:`HiddenStateCapture` during its prefill; tests and
dataset builders call :func:`capture_hidden_states` directly, without HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from sglang_patch.layer_ids import validate_aux_layer_ids

if TYPE_CHECKING:  # torch stays out of `import eagleflow.engine.capture`
    import torch
    from torch import nn


def decoder_layers_and_norm(model: nn.Module) -> tuple[Sequence[nn.Module], nn.Module]:
    """The decoder-layer list and the final norm of a causal LM (``model.model.layers`` / ``.norm``).

    :raises ValueError: when the model has no ``layers`` list or ``norm`` on its decoder.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if layers is None or norm is None:
        raise ValueError(
            f"{type(model).__name__}: its decoder {type(decoder).__name__} has no `layers` list and "
            "`norm` module; hidden-state capture supports decoder-only models laid out like Llama/DeepSeek"
        )
    return layers, norm


class HiddenStateCapture:
    """Context manager that records, during one forward pass, the states of ``aux_layer_ids``.

    Use it around a single-sequence prefill (batch size 1); :meth:`stacked` then returns
    ``[seq_len, len(aux_layer_ids) + 1, hidden]`` in bf16. A later pass inside the same context
    (a decode step) overwrites the records, so leave the context before decoding.

    :param model: a ``transformers`` causal LM (see :func:`decoder_layers_and_norm`).
    :param aux_layer_ids: layer ids in slot order, each in ``[0, num_layers]``.
    """

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]) -> None:
        self.layers, self.norm = decoder_layers_and_norm(model)
        self.num_layers = len(self.layers)
        self.aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        self._records: dict[int, torch.Tensor] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> HiddenStateCapture:
        self._records.clear()
        for k in sorted(set(self.aux_layer_ids)):
            if k < self.num_layers:
                self._handles.append(
                    self.layers[k].register_forward_pre_hook(self._recorder(k), with_kwargs=True)
                )
        # The final norm's input is layer id n: the last layer's output before the norm.
        self._handles.append(self.norm.register_forward_pre_hook(self._recorder(self.num_layers), with_kwargs=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _recorder(self, layer_id: int):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            # A copy: nothing guarantees a later module leaves its input tensor unchanged.
            self._records[layer_id] = hidden.detach().clone()

        return hook

    def stacked(self) -> torch.Tensor:
        """``[seq_len, n_slots, hidden]`` bf16 of the last recorded pass (aux ids in order, then final)."""
        import torch

        wanted = [*self.aux_layer_ids, self.num_layers]
        missing = [k for k in wanted if k not in self._records]
        if missing:
            raise RuntimeError(f"no state was recorded for layer ids {missing}; did a forward pass run inside the context?")
        states = [self._records[k] for k in wanted]
        if states[0].dim() != 3 or states[0].shape[0] != 1:
            raise RuntimeError(f"capture expects one sequence (batch size 1), got states of shape {tuple(states[0].shape)}")
        from sglang_patch.sample_file import STORAGE_DTYPES

        # bf16, the dtype SGLang serves in: the dump writer stores it as is or quantises it to fp8.
        return torch.stack([s[0] for s in states], dim=1).to(STORAGE_DTYPES["bf16"])


class AuxStateCapture(HiddenStateCapture):
    """The aux slots alone, in the model's dtype: what an EAGLE-3 drafter reads from its target."""

    def aux(self) -> torch.Tensor:
        """``[seq_len, len(aux_layer_ids) * hidden]`` of the last recorded pass (aux ids in order)."""
        import torch

        missing = [k for k in self.aux_layer_ids if k not in self._records]
        if missing:
            raise RuntimeError(f"no state was recorded for layer ids {missing}")
        return torch.cat([self._records[k][0] for k in self.aux_layer_ids], dim=-1)


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (where inputs must go)."""
    return next(model.parameters()).device


def capture_hidden_states(model: nn.Module, input_ids: Sequence[int], aux_layer_ids: Sequence[int]) -> torch.Tensor:
    """Run one prefill of ``input_ids`` and return ``[seq_len, len(aux_layer_ids) + 1, hidden]`` bf16.

    Slots follow docs/design.md §3.1: the state entering each aux layer, then the final pre-norm state.
    Only the decoder runs (no ``lm_head``), so a large vocabulary costs nothing here.
    """
    import torch

    if len(input_ids) == 0:
        raise ValueError("input_ids is empty")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    ids = torch.tensor([list(input_ids)], dtype=torch.long, device=model_device(model))
    with torch.inference_mode(), HiddenStateCapture(model, aux_layer_ids) as capture:
        decoder(input_ids=ids, use_cache=False)
        return capture.stacked()
