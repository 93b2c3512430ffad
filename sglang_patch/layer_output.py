"""How the capture hook reads the residual stream after a decoder layer, one way per SGLang API.

Layer id k is ``hidden_states + residual`` entering decoder layer k (docs/design.md §3.1). A post
hook on layer k-1 sees that layer's output, and SGLang hands it over in one of two shapes
(:data:`sglang_patch.hook_spec.LAYER_BOUNDARY_APIS` says which release has which):

- ``layer_tuple`` (0.5.10-0.5.20): the layer returns ``(hidden_states, residual, topk)``, both
  complete on every rank. The sum is taken before the hook returns: the next layer's fused
  add+norm rewrites both in place. On the GPU it is a new tensor, copied out on the same stream
  (to pinned memory, or an fp8 request's staging on the GPU); on CPU tensors it is a
  :class:`StateSum`, added straight into each request's buffer (one pass over the memory, not a
  new tensor and then a copy). Rank 0 alone reads it.
- ``residual_stream`` (0.5.21-0.5.23): the layer returns ``(hidden_states, topk_indices)``; the
  residual lives in ``forward_batch.residual_stream`` and ``hidden_states`` may be an opaque
  owed value (a tensor-parallel sum not yet done). SGLang's own
  ``sglang.srt.layers.layer_boundary.residual.batch.snapshot(output[0], forward_batch)`` returns
  a fresh ``hidden + residual``; with a sum pending it completes it on a copy, an all-reduce, so
  every TP rank must call it at the same point or the ranks' collectives fall out of step.
  It raises NotImplementedError where it cannot (deferred MoE finalize, mHC residual updates).
  Nothing else of that package is used: its other names change from release to release.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sglang_patch.hook_spec import LAYER_TUPLE, RESIDUAL_STREAM, UnsupportedSGLangVersion, layer_boundary_api

if TYPE_CHECKING:
    import torch

SNAPSHOT_MODULE = "sglang.srt.layers.layer_boundary.residual.batch"
UNSNAPSHOTTABLE = (
    "launch without --moe-runner-backend flashinfer_trtllm (its deferred MoE finalize hands the next layer "
    "an unfinished output) and keep --enforce-disable-flashinfer-allreduce-fusion; mHC models (hc_mult > 1) "
    "cannot be captured"
)


class LayerOutputReader(Protocol):
    """Reads the residual-stream state out of a decoder layer's output."""

    api: str
    every_rank: bool  # True: every TP rank must call read() at the same point (a collective)

    def read(self, output: Sequence[Any], forward_batch: Any) -> torch.Tensor | StateSum: ...


class StateSum:
    """``hidden + residual`` of CPU tensors, not yet added: :meth:`add_into` adds rows of it into
    a destination (a request's host buffer) at once. Sliced like a tensor along the tokens."""

    is_cuda = False

    def __init__(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        self.hidden, self.residual = hidden, residual

    @property
    def shape(self) -> torch.Size:
        return self.hidden.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def __getitem__(self, rows: slice) -> StateSum:
        return StateSum(self.hidden[rows], self.residual[rows])

    def add_into(self, out: torch.Tensor) -> None:
        import torch

        torch.add(self.hidden, self.residual, out=out)


class LayerTupleReader:
    """``hidden_states + residual`` from a layer's ``(hidden_states, residual, ...)`` output."""

    api = LAYER_TUPLE
    every_rank = False

    def read(self, output: Sequence[Any], forward_batch: Any) -> torch.Tensor | StateSum:
        hidden_states, residual = output[0], output[1]
        if getattr(hidden_states, "_sglang_needs_allreduce_fusion", False):
            # The MLP all-reduce is deferred into the next layer: this is a per-rank partial sum.
            raise RuntimeError(
                "the layer output is a per-rank partial sum (flashinfer all-reduce fusion); "
                "launch SGLang with --enforce-disable-flashinfer-allreduce-fusion"
            )
        if residual is None:
            return hidden_states.detach()
        if not hidden_states.is_cuda:
            return StateSum(hidden_states.detach(), residual.detach())
        return hidden_states.detach() + residual.detach()


class ResidualStreamReader:
    """SGLang's own ``snapshot(output[0], forward_batch)``: hidden + residual, owed sums completed on a copy."""

    api = RESIDUAL_STREAM
    every_rank = True

    def __init__(self, snapshot: Callable[[Any, Any], torch.Tensor]) -> None:
        self._snapshot = snapshot

    def read(self, output: Sequence[Any], forward_batch: Any) -> torch.Tensor:
        try:
            return self._snapshot(output[0], forward_batch)
        except NotImplementedError as exc:
            raise RuntimeError(f"SGLang cannot snapshot this layer's residual stream ({exc}): {UNSNAPSHOTTABLE}") from exc


def reader_for(version: str) -> LayerOutputReader:
    """The reader for the installed SGLang: chosen by what it has, which must agree with its version.

    :raises UnsupportedSGLangVersion: outside the supported range, or a release whose layer-boundary
        API is not the one its version promises (a development build in between, say).
    """
    expected = layer_boundary_api(version)
    snapshot = _installed_snapshot()
    found = RESIDUAL_STREAM if snapshot is not None else LAYER_TUPLE
    if found != expected:
        raise UnsupportedSGLangVersion(
            version, f"its release should have the {expected} layer API, but {SNAPSHOT_MODULE}.snapshot is "
            + ("present" if snapshot is not None else "missing")
        )
    return ResidualStreamReader(snapshot) if snapshot is not None else LayerTupleReader()


def _installed_snapshot() -> Callable[[Any, Any], torch.Tensor] | None:
    import importlib

    try:
        module = importlib.import_module(SNAPSHOT_MODULE)
    except ImportError:
        return None
    return getattr(module, "snapshot", None)
