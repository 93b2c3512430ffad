"""TEST ONLY: capture faults the reference engine can be told to make (the ``capture_fault`` test fault, :mod:`eagleflow.engine.reference.faults`).

The ``verify-capture`` gate claims to catch the misalignments EAGLE-3 pipelines are known for;
these faults make the engine commit each of them for real, so the tests can show the gate
naming the right cause. Off by default; never set them in a real run.

- ``post-norm-final``: the final slot holds the final norm's *output* instead of its input;
- ``layer-shift``: every slot holds the state one layer earlier than its id says (id k holds
  id k-1's state, the final slot the input of the last layer; id 0, having no earlier state,
  holds id 1's);
- ``partial-sum``: every slot holds what rank 0 of :data:`PARTIAL_SUM_RANKS` tensor-parallel
  ranks has before the all-reduce: for id k >= 1 the state entering layer k-1 plus that layer's
  contribution divided by the rank count (an even share); for id 0 the embedding rows of the
  tokens in its vocabulary shard (the first 1/ranks of the ids) and zeros for the others;
  ``/server_info`` then reports that many ranks as ``tp_size``, as such an engine would;
- ``radix-cache``: a prompt sharing a prefix with an earlier one reuses it as SGLang's radix
  cache does (``cached_tokens`` in the answer, at most ``len - 1`` tokens and none before
  ``logprob_start_len``), and the dump holds only the states computed (13 tokens in, 12 out).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from eagleflow.engine.capture import HiddenStateCapture

if TYPE_CHECKING:
    import torch
    from torch import nn

CaptureFault = Literal["post-norm-final", "layer-shift", "partial-sum", "radix-cache"]
PARTIAL_SUM_RANKS = 2
_NORM_OUTPUT = -1  # record key of the final norm's output


class FaultyCapture(HiddenStateCapture):
    """TEST ONLY: records every layer's input and the final norm's output, then builds the
    slots the way ``fault`` gets them wrong (see the module docstring)."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int], fault: CaptureFault) -> None:
        super().__init__(model, aux_layer_ids)
        self.fault = fault
        self.embedding = model.get_input_embeddings()
        self._input_ids: torch.Tensor | None = None

    def __enter__(self) -> FaultyCapture:
        self._records.clear()
        self._handles.append(self.embedding.register_forward_pre_hook(self._record_input_ids))
        for k, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._recorder(k), with_kwargs=True))
        self._handles.append(self.norm.register_forward_pre_hook(self._recorder(self.num_layers), with_kwargs=True))
        self._handles.append(self.norm.register_forward_hook(self._record_norm_output))
        return self

    def _record_input_ids(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._input_ids = args[0][0].detach().clone()

    def _record_norm_output(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._records[_NORM_OUTPUT] = (output[0] if isinstance(output, tuple) else output).detach().clone()

    def _state(self, r: dict[int, torch.Tensor], layer_id: int) -> torch.Tensor:
        if self.fault == "layer-shift":
            return r[layer_id - 1] if layer_id >= 1 else r[1]
        if self.fault == "partial-sum":
            if layer_id == 0:
                assert self._input_ids is not None
                in_shard = self._input_ids < self.embedding.num_embeddings // PARTIAL_SUM_RANKS
                return r[0] * in_shard[:, None]
            before = r[layer_id - 1]
            return before + (r[layer_id] - before) / PARTIAL_SUM_RANKS
        return r[layer_id]

    def stacked(self) -> torch.Tensor:
        import torch

        from sglang_patch.sample_file import STORAGE_DTYPES

        r = {k: v[0].float() for k, v in self._records.items()}
        slots = [self._state(r, k) for k in self.aux_layer_ids]
        final = r[_NORM_OUTPUT] if self.fault == "post-norm-final" else self._state(r, self.num_layers)
        return torch.stack([*slots, final], dim=1).to(STORAGE_DTYPES["bf16"])  # what HiddenStateCapture gives


class PrefixCache:
    """TEST ONLY: the prefix SGLang's radix cache would reuse for a prompt (``radix-cache`` fault)."""

    def __init__(self) -> None:
        self._prompts: list[list[int]] = []

    def reuse(self, input_ids: Sequence[int], return_logprob: bool, logprob_start_len: int) -> int:
        """Tokens of ``input_ids`` an earlier prompt covers, capped as ``Req._compute_max_prefix_len`` caps them;
        then remembers the prompt."""
        limit = len(input_ids) - 1
        if return_logprob:
            limit = min(limit, logprob_start_len)
        best = 0
        for earlier in self._prompts:
            common = 0
            for a, b in zip(earlier, input_ids):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        self._prompts.append(list(input_ids))
        return max(0, min(best, limit))


def server_info_overrides(fault: CaptureFault | None) -> dict[str, Any]:
    """What ``/server_info`` reports differently under ``fault`` (the engine it pretends to be)."""
    if fault == "partial-sum":
        return {"tp_size": PARTIAL_SUM_RANKS}
    if fault == "radix-cache":
        return {"disable_radix_cache": False}
    return {}
