"""Plain stand-ins shaped like SGLang's DeepSeek-V2/V3 code, for driving the capture hook on CPU.

They carry exactly the names the hook relies on, each checked against the real wheels by
test_sglang_source.py: ``DeepseekV3ForCausalLM.model`` (and Kimi-K2.5's
``language_model.model``) is a ``DeepseekV2Model`` with ``embed_tokens``, ``layers`` and
``norm``; a decoder layer has ``layer_id`` and ``config.num_hidden_layers``; ``ForwardBatch``
has ``forward_mode``, ``rids``, ``input_ids`` and the ``extend_{seq,prefix}_lens[_cpu]`` fields.
The layers come in SGLang's two layer-boundary APIs (``config.layer_api``):

- ``layer_tuple`` (0.5.10-0.5.20): called as ``layer(positions, hidden_states, forward_batch,
  residual, zero_allocator, ...)``, returns ``(hidden_states, residual, topk_indices)``;
- ``residual_stream`` (0.5.21-0.5.23): called as ``layer(positions, hidden_states,
  forward_batch, zero_allocator, ...)``, returns ``(owed value, topk_indices)``. The residual
  lives in ``forward_batch.residual_stream``; the layer's MLP output is this rank's part of a
  tensor-parallel sum, owed until the next layer (or the final norm) completes it with an
  all-reduce across :class:`TensorParallelGroup`'s ranks. :func:`snapshot` is SGLang's
  ``residual.batch.snapshot``, with the semantics test_sglang_source.py reads in the wheels.

The norms fold the residual add in place, the way SGLang's ``fused_add_rmsnorm`` does, so a
hook that kept references to a layer's tensors instead of reading them at once would read
overwritten values; with several ranks each rank's partial sum differs from the whole, so a
hook that read a rank's partial, or skipped the collective on some rank, gets the wrong state
or a broken barrier. The model also records SGLang's own aux capture (``hidden_states +
residual`` before layer k) and the pre-norm final state: the oracle the dumps are compared with.
"""

from __future__ import annotations

import enum
import fnmatch
import importlib
import sys
import threading
import types
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from sglang_patch import hook_spec
from sglang_patch.layer_output import SNAPSHOT_MODULE

LAYER_TUPLE, RESIDUAL_STREAM = hook_spec.LAYER_TUPLE, hook_spec.RESIDUAL_STREAM


class ForwardMode(enum.IntEnum):
    """The subset of SGLang's ForwardMode the hook consults, with the same method semantics."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY


@dataclass
class ForwardBatch:
    forward_mode: Any
    input_ids: torch.Tensor
    rids: list[str] | None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = field(default=None)
    residual_stream: Any = None
    can_run_tbo: bool = False


def extend_batch(
    requests: dict[str, list[int]], prefix_lens: dict[str, int] | None = None, mode: Any = ForwardMode.EXTEND
) -> ForwardBatch:
    """One batch holding ``requests`` (rid -> the token ids of this pass), concatenated in order."""
    prefix_lens = prefix_lens or {}
    rids = list(requests)
    seq_lens = [len(requests[r]) for r in rids]
    prefixes = [prefix_lens.get(r, 0) for r in rids]
    ids = torch.tensor([t for r in rids for t in requests[r]], dtype=torch.int64)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefixes, seq_lens)]) if rids else torch.empty(0)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=ids,
        rids=rids,
        extend_seq_lens_cpu=seq_lens,
        extend_prefix_lens_cpu=prefixes,
        extend_seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(prefixes, dtype=torch.int32),
        positions=positions,
    )


class RMSNorm(nn.Module):
    """``norm(x)`` or, with a residual, SGLang's fused add+norm that rewrites both tensors in place."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        x.copy_(self._norm(residual))
        return x, residual


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.config = config
        self.layer_id = layer_id
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = nn.Linear(config.hidden_size, config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size)
        self.mlp = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: torch.Tensor | None,
        zero_allocator: Any,
        gemm_output_zero_allocator: Any = None,
        llama_4_scaling: Any = None,
        prev_topk_indices: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, None]:
        if residual is None:  # SGLang's prepare_attn for the first layer: the residual aliases the input
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = torch.tanh(self.self_attn(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = torch.tanh(self.mlp(hidden_states))
        return hidden_states, residual, None


# -- SGLang 0.5.21+: the residual stream --------------------------------------------------------


class TensorParallelGroup:
    """An all-reduce over ranks that run in threads. As with NCCL, each rank's n-th call pairs
    with every other rank's n-th call; a rank that skips one leaves the others waiting (a broken
    barrier after ``timeout``) or summing the wrong tensors."""

    def __init__(self, size: int, timeout: float = 20.0) -> None:
        self.size = size
        self.calls = [0] * size
        self._barrier = threading.Barrier(size, timeout=timeout)
        self._inputs: list[torch.Tensor | None] = [None] * size

    def all_reduce(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        self.calls[rank] += 1
        if self.size == 1:
            return tensor.clone()
        self._inputs[rank] = tensor
        self._barrier.wait()
        total = self._inputs[0].clone()  # type: ignore[union-attr]
        for part in self._inputs[1:]:
            total += part  # type: ignore[operator]
        self._barrier.wait()  # every rank has read the inputs before the next call overwrites them
        return total


@dataclass
class OwedSum:
    """SGLang's DeclaredSum: completing it is the group's all-reduce."""

    group: TensorParallelGroup
    rank: int

    def complete(self, value: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(value, self.rank)


class DeferredFinalize:
    """A MoE output handed on unfinished (flashinfer_trtllm): nothing but its consumer can complete it."""


@dataclass
class Contribution:
    """SGLang's Contribution: a layer's output, how it joins the residual, and what it still owes."""

    value: torch.Tensor
    owed: OwedSum | DeferredFinalize | None
    update: str = "plain"  # "mhc": hyper-connection residual updates, not a plain add

    def complete(self) -> torch.Tensor:
        if isinstance(self.owed, OwedSum):
            self.value, self.owed = self.owed.complete(self.value), None
        elif self.owed is not None:
            self.owed = None  # its consumer's fused finalize (not modelled: the value is already whole)
        return self.value


class OwedValue:
    """What a layer returns while its output is owed: an opaque handle, not a tensor."""


class ResidualStream:
    """``forward_batch.residual_stream``: the last layer's pending contribution and the residual."""

    def __init__(self) -> None:
        self.pending: Contribution | None = None
        self.residual: torch.Tensor | None = None
        self.handle: Any = None

    def check(self, hidden: Any) -> None:
        if hidden is not self.handle:
            raise RuntimeError("not the stream's current output")

    def snapshot(self, hidden: Any) -> torch.Tensor:
        """SGLang's ``ResidualStream.snapshot`` (0.5.21-0.5.23): a fresh hidden + residual, owed sums
        completed on a copy."""
        self.check(hidden)
        pending = self.pending
        if pending is None:
            return hidden.clone()
        if pending.update != "plain":
            raise NotImplementedError("snapshot requires a plain residual update")
        if pending.owed is None:
            value = pending.value
        elif isinstance(pending.owed, OwedSum):
            value = pending.owed.complete(pending.value.clone())
        else:
            raise NotImplementedError("a finalize handoff requires main-output capture")
        return value.clone() if self.residual is None else value + self.residual

    def take(self, hidden: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the next consumer does first: complete the owed work (every rank), keep the residual."""
        self.check(hidden)
        value = self.pending.complete() if self.pending is not None else hidden
        return value, self.residual


def snapshot(hidden_states: Any, forward_batch: ForwardBatch) -> torch.Tensor:
    """``sglang.srt.layers.layer_boundary.residual.batch.snapshot``."""
    return forward_batch.residual_stream.snapshot(hidden_states)


class StreamDecoderLayer(DecoderLayer):
    """A 0.5.21+ DeepseekV2DecoderLayer: no residual argument, the output owed until the next layer."""

    def __init__(self, config: Any, layer_id: int, oracle: dict[int, torch.Tensor]) -> None:
        super().__init__(config, layer_id)
        self._oracle = oracle

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: Any,
        forward_batch: ForwardBatch,
        zero_allocator: Any,
        gemm_output_zero_allocator: Any = None,
        llama_4_scaling: Any = None,
        prev_topk_indices: Any = None,
        captured_last_layer_outputs: Any = None,
        next_full_attention_layer_id: Any = None,
    ) -> tuple[Any, None]:
        stream: ResidualStream = forward_batch.residual_stream
        if stream.pending is None:  # the first layer: the embedding is the residual
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            value, residual = stream.take(hidden_states)
            self._oracle[self.layer_id] = value + residual
            hidden_states, residual = self.input_layernorm(value, residual)
        hidden_states = torch.tanh(self.self_attn(hidden_states))
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        tp = self.config.tp
        partial = torch.tanh(self.mlp(hidden_states)) * tp.share  # this rank's part of the MLP's sum
        owed: OwedSum | DeferredFinalize = DeferredFinalize() if self.config.deferred_finalize else OwedSum(tp.group, tp.rank)
        stream.pending = Contribution(partial, owed, "mhc" if self.config.mhc else "plain")
        stream.residual = residual
        stream.handle = OwedValue()
        return stream.handle, None


@dataclass
class TensorParallelRank:
    """This rank's place in a TP group; its MLP share, so the ranks' partial sums add up to the whole."""

    group: TensorParallelGroup
    rank: int

    @property
    def share(self) -> float:
        return (self.rank + 1) / sum(range(1, self.group.size + 1))


def single_rank() -> TensorParallelRank:
    return TensorParallelRank(TensorParallelGroup(1), 0)


class DeepseekV2Model(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer_api = config.layer_api
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.oracle: dict[int, torch.Tensor] = {}
        if self.layer_api == RESIDUAL_STREAM:
            layers = [StreamDecoderLayer(config, i, self.oracle) for i in range(config.num_hidden_layers)]
        else:
            layers = [DecoderLayer(config, i) for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.layer_api == RESIDUAL_STREAM:
            return self._forward_stream(input_ids, positions, forward_batch)
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        self.oracle.clear()
        for i, layer in enumerate(self.layers):
            self.oracle[i] = hidden_states.clone() if residual is None else hidden_states + residual
            hidden_states, residual, _ = layer(positions, hidden_states, forward_batch, residual, None, None, None, prev_topk_indices=None)
        self.oracle[len(self.layers)] = hidden_states + residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states

    def _forward_stream(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """0.5.21+: residual_batch.start, the layers, complete_output, then the fused final norm."""
        hidden_states = self.embed_tokens(input_ids)
        self.oracle.clear()
        self.oracle[0] = hidden_states.clone()
        forward_batch.residual_stream = ResidualStream()
        for layer in self.layers:
            hidden_states, _ = layer(
                positions, hidden_states, forward_batch, None, None, None,
                prev_topk_indices=None, captured_last_layer_outputs=None, next_full_attention_layer_id=None,
            )
        value, residual = forward_batch.residual_stream.take(hidden_states)
        forward_batch.residual_stream = None
        self.oracle[len(self.layers)] = value + residual
        normed, _ = self.norm(value, residual)
        return normed


class DeepseekV3ForCausalLM(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.model = DeepseekV2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.lm_head(self.model(input_ids, positions, forward_batch))

    @property
    def oracle(self) -> dict[int, torch.Tensor]:
        return self.model.oracle


class KimiK25ForConditionalGeneration(nn.Module):
    """Kimi-K2.5's wrapper: a vision tower (with its own ``layers``) beside ``language_model``.

    :param alias_model: also register the text model as ``self.model``, as SGLang 0.5.10 does
        (``self.model = self.language_model.model``); later releases make ``model`` a property.
    """

    def __init__(self, config: Any, alias_model: bool = False) -> None:
        super().__init__()
        vision = SimpleNamespace(hidden_size=config.hidden_size, num_hidden_layers=2, vocab_size=8)
        self.vision_tower = nn.Module()
        self.vision_tower.model = nn.Module()
        self.vision_tower.model.layers = nn.ModuleList([DecoderLayer(vision, i) for i in range(2)])
        self.language_model = DeepseekV3ForCausalLM(config)
        if alias_model:
            self.model = self.language_model.model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        return self.language_model(input_ids, positions, forward_batch)

    @property
    def oracle(self) -> dict[int, torch.Tensor]:
        return self.language_model.oracle


def tiny_config(num_layers: int = 6, hidden: int = 16, vocab: int = 50, **extra: Any) -> SimpleNamespace:
    defaults = dict(layer_api=LAYER_TUPLE, tp=single_rank(), deferred_finalize=False, mhc=False)
    return SimpleNamespace(num_hidden_layers=num_layers, hidden_size=hidden, vocab_size=vocab, **{**defaults, **extra})


def build_model(
    kind: str = "deepseek",
    num_layers: int = 6,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    layer_api: str = LAYER_TUPLE,
    tp: TensorParallelRank | None = None,
    **config: Any,
) -> nn.Module:
    """``kind``: "deepseek", "kimi", or "kimi-aliased" (SGLang 0.5.10's Kimi-K2.5 tree).

    ``layer_api``: the SGLang release's layer-boundary API; ``tp``: this model's rank (each rank
    of a simulated TP group builds its own model, same seed, same weights); ``config``:
    ``deferred_finalize`` / ``mhc`` make every layer's output something a snapshot refuses.
    """
    torch.manual_seed(seed)
    config = tiny_config(num_layers, layer_api=layer_api, tp=tp or single_rank(), **config)
    if kind == "deepseek":
        model: nn.Module = DeepseekV3ForCausalLM(config)
    else:
        model = KimiK25ForConditionalGeneration(config, alias_model=kind == "kimi-aliased")
    return model.to(dtype).eval()


def register_forward_hooks(model: nn.Module, hook_specs: list[dict[str, Any]], remove_duplicate: bool = True) -> list[str]:
    """What SGLang's hook_manager.register_forward_hooks does (checked against it in test_sglang_source).

    Resolves ``hook_factory`` ("module:attr"), calls it once with ``config``, registers the
    returned callable as a post forward hook on every module whose name matches a pattern.
    Returns the names hooked. ``remove_duplicate=False`` lists a module under each of its names
    (SGLang keeps torch's default, True), to show a module hooked twice is harmless.
    """
    hooked: list[str] = []
    for spec in hook_specs:
        module_name, attr = spec["hook_factory"].split(":", 1)
        hook = getattr(importlib.import_module(module_name), attr)(spec.get("config") or {})
        for name, module in dict(model.named_modules(remove_duplicate=remove_duplicate)).items():
            if any(fnmatch.fnmatch(name, pattern) for pattern in spec["target_modules"]):
                module.register_forward_hook(hook)
                hooked.append(name)
    return hooked


def run(model: nn.Module, batch: ForwardBatch) -> torch.Tensor:
    """One forward pass the way SGLang runs it: inference mode, the batch's tokens concatenated."""
    with torch.inference_mode():
        return model(batch.input_ids, batch.positions, batch)


class FakeSGLang:
    """A stand-in ``sglang`` package in ``sys.modules``: ``__version__``, the TP rank the hook asks
    for (per thread, so simulated ranks can share one process) and, for releases with the
    residual-stream API, ``layer_boundary.residual.batch.snapshot``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self._local = threading.local()

    def install(self, version: str = "0.5.23", tp_rank: int = 0) -> None:
        self.default_rank = tp_rank
        modules: dict[str, types.ModuleType] = {}
        for name in ("sglang", "sglang.srt", "sglang.srt.distributed", "sglang.srt.distributed.parallel_state"):
            modules[name] = types.ModuleType(name)
        modules["sglang"].__version__ = version  # type: ignore[attr-defined]
        modules["sglang.srt.distributed.parallel_state"].get_tensor_model_parallel_rank = self.rank  # type: ignore[attr-defined]
        stream_api = hook_spec.is_supported_version(version) and hook_spec.layer_boundary_api(version) == RESIDUAL_STREAM
        if stream_api:
            parts = SNAPSHOT_MODULE.split(".")
            for depth in range(3, len(parts) + 1):
                modules[".".join(parts[:depth])] = types.ModuleType(".".join(parts[:depth]))
            modules[SNAPSHOT_MODULE].snapshot = snapshot  # type: ignore[attr-defined]
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            if name not in modules:
                self._monkeypatch.delitem(sys.modules, name)
        for name, module in modules.items():
            self._monkeypatch.setitem(sys.modules, name, module)

    def rank(self) -> int:
        return getattr(self._local, "rank", self.default_rank)

    def set_thread_rank(self, rank: int) -> None:
        self._local.rank = rank
