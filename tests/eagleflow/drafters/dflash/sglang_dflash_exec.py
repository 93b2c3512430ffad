"""SGLang's DFlash draft model class, executed from a wheel's real source on CPU.

``sglang/srt/models/dflash.py`` and the ``sglang/srt/speculative/dflash_utils.py`` it parses its
config with run as they are. A few definitions whose value matters are taken from the wheel's own
source too and executed alone (their modules import half of SGLang): ``get_rope_config``
(``utils/hf_transformers/common.py``), ``default_weight_loader`` (``model_loader/weight_utils.py``),
``AttentionType`` (``layers/radix_attention.py``) and ``RMSNorm``'s ``__init__`` and
``forward_native`` (``layers/layernorm.py``, the path SGLang takes off the GPU kernels), so a norm
holds the weight the file gives it and computes as SGLang does. Everything else is a stand-in from
``sglang_exec``: the parallel linear layers hold one empty weight and record what their loader
receives (with the shard id), ``get_rope`` records its arguments, ``RadixAttention`` records its
constructor's (it cannot run here: it needs a KV pool and an attention backend), the single-GPU
values (tensor-parallel size 1, rank 0, no draft attention backend, not an NPU), ``"eager"`` as the
compiler backend (``torch.compile`` decorates functions at import), and inert objects for the rest.
"""

from __future__ import annotations

import ast
import contextlib
import enum
import sys
import types
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

from sglang_exec import LoadRecorder, StubModule, imported_sglang_modules, stub_value
from sglang_wheels import Wheel

DFLASH = "sglang/srt/models/dflash.py"
DFLASH_UTILS = "sglang/srt/speculative/dflash_utils.py"
HF_COMMON = "sglang/srt/utils/hf_transformers/common.py"
WEIGHT_UTILS = "sglang/srt/model_loader/weight_utils.py"
RADIX_ATTENTION = "sglang/srt/layers/radix_attention.py"
LAYERNORM = "sglang/srt/layers/layernorm.py"
REAL_MODULES = {"sglang.srt.speculative.dflash_utils": DFLASH_UTILS, "sglang.srt.models.dflash": DFLASH}
# The fused parameter and shard each separately saved projection is loaded into (tensor parallel size 1).
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def wheel_definition(wheel: Wheel, filename: str, name: str, namespace: dict[str, Any]) -> Any:
    """The top-level function or class ``name`` of ``filename``, executed alone from the wheel's source in ``namespace``."""
    for node in wheel.tree(filename).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
            exec(compile(ast.unparse(node), f"{wheel.path}/{filename}", "exec"), namespace)
            return namespace[name]
    raise AssertionError(f"{name} is not defined at the top of {filename} in sglang {wheel.version}")


def sglang_rms_norm(wheel: Wheel) -> type[nn.Module]:
    """SGLang's ``RMSNorm`` class, its base (a custom-op dispatcher) replaced by ``nn.Module``; ``forward`` is ``forward_native``."""
    namespace: dict[str, Any] = {
        "BaseFusedOp": nn.Module, "nn": nn, "torch": torch, "F": F, "Optional": Optional, "Tuple": Tuple, "Union": Union,
        "_use_aiter": False, "_is_cpu_amx_available": False,
    }
    cls = wheel_definition(wheel, LAYERNORM, "RMSNorm", namespace)
    cls.forward = cls.forward_native
    return cls


class DFlashRecorder(LoadRecorder):
    """``LoadRecorder`` plus each ``RadixAttention``'s constructor arguments, one dict per draft layer."""

    def __init__(self) -> None:
        super().__init__()
        self.attentions: list[dict[str, Any]] = []

    def radix_attention(self) -> type[nn.Module]:
        recorder = self

        class RadixAttention(nn.Module):
            def __init__(self, **kwargs: Any) -> None:  # dflash.py passes every argument by name
                super().__init__()
                recorder.attentions.append(dict(kwargs))
                self.layer_id = kwargs["layer_id"]

            def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
                raise NotImplementedError("RadixAttention needs SGLang's KV pool and attention backend: it cannot run on CPU")

        return RadixAttention


class DFlashStubModule(StubModule):
    """A stubbed ``sglang`` module whose names in ``overrides`` are the given values."""

    def __init__(self, name: str, recorder: LoadRecorder, overrides: dict[str, Any]) -> None:
        super().__init__(name, recorder)
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        if name in self._overrides:
            return self._overrides[name]
        return stub_value(name, self._recorder)


def overrides(wheel: Wheel, recorder: DFlashRecorder) -> dict[str, Any]:
    """The names whose value matters: SGLang's own definitions, recorders, single-GPU values."""
    real_loader: Callable[[torch.Tensor, torch.Tensor], None] = wheel_definition(wheel, WEIGHT_UTILS, "default_weight_loader", {"torch": torch})

    def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
        recorder.loads.append((param, loaded, None))
        real_loader(param, loaded)

    return {
        "RMSNorm": sglang_rms_norm(wheel),
        "AttentionType": wheel_definition(wheel, RADIX_ATTENTION, "AttentionType", {"Enum": enum.Enum}),
        "RadixAttention": recorder.radix_attention(),
        "get_rope_config": wheel_definition(wheel, HF_COMMON, "get_rope_config", {}),
        "default_weight_loader": default_weight_loader,
        "get_compiler_backend": lambda *args, **kwargs: "eager",
        "get_spec": lambda: types.SimpleNamespace(speculative_draft_attention_backend=None, speculative_draft_window_size=None),
        "get_parallel": lambda: types.SimpleNamespace(tp_size=1, tp_rank=0),
        "is_npu": lambda: False,
    }


@contextlib.contextmanager
def sglang_dflash(
    wheel: Wheel,
    real_modules: Mapping[str, str] = REAL_MODULES,
    more_overrides: Callable[[Wheel, DFlashRecorder], dict[str, Any]] | None = None,
    extra_modules: Mapping[str, types.ModuleType] | None = None,
) -> Iterator[tuple[types.ModuleType, DFlashRecorder]]:
    """``dflash`` of ``wheel`` as a module (and the recorder of what it built and loaded), for the ``with`` block.

    A family built on DFlash (DSpark) runs more of the wheel's modules for real (``real_modules``, in import
    order, DFlash's among them), gives more names a value (``more_overrides``) and more non-sglang modules a
    stand-in (``extra_modules``, e.g. ``triton``, which the GPU kernels' modules import at their top).
    """
    recorder = DFlashRecorder()
    values = {**overrides(wheel, recorder), **(more_overrides(wheel, recorder) if more_overrides else {})}
    stubbed = tuple(extra_modules or {})
    ours = lambda name: name == "sglang" or name.startswith(("sglang.", *stubbed))  # noqa: E731
    saved = {name: module for name, module in sys.modules.items() if ours(name)}
    try:
        sys.modules.update(extra_modules or {})
        wanted = imported_sglang_modules(wheel, tuple(real_modules.values())) | {"sglang", "sglang.srt", "sglang.srt.models"}
        for name in sorted(wanted):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                if prefix not in real_modules:
                    sys.modules.setdefault(prefix, DFlashStubModule(prefix, recorder, values))
        for name, filename in real_modules.items():  # dflash_utils first: dflash imports it
            module = types.ModuleType(name)
            module.__file__ = f"{wheel.path}/{filename}"
            sys.modules[name] = module
            exec(compile(wheel.text(filename), filename, "exec"), module.__dict__)
        yield sys.modules["sglang.srt.models.dflash"], recorder
    finally:
        for name in [n for n in sys.modules if ours(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def misrouted(params: Mapping[str, nn.Parameter], weights: Mapping[str, torch.Tensor], loads: list) -> list[str]:
    """Each load ``(param, tensor, shard)`` whose tensor is not the file's tensor (``weights``) of the parameter
    (``params``) and shard it went to."""
    names = {id(p): name for name, p in params.items()}
    files = {id(t): name for name, t in weights.items()}
    wrong = []
    for param, tensor, shard in loads:
        source, target = files.get(id(tensor), "?"), names.get(id(param), "?")
        module, _, kind = source.rpartition(".")  # kind: weight or bias
        owner, _, leaf = module.rpartition(".")
        # Only the decoder layers' projections are fused (DSpark's markov_head.gate_proj is its own).
        fused, fused_shard = FUSED.get(leaf, (leaf, None)) if source.startswith("layers.") else (leaf, None)
        if (target, shard) != (".".join(filter(None, (owner, fused, kind))), fused_shard):
            wrong.append(f"{source} -> {target} (shard {shard!r})")
    return wrong


def weight_files(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"no safetensors file in {folder}"
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def load_into_sglang_dflash(
    wheel: Wheel, folder: Path, weights: Mapping[str, torch.Tensor] | None = None
) -> tuple[nn.Module, dict[str, nn.Parameter], list[str], set[int], list, list[dict[str, Any]], list[dict[str, Any]]]:
    """Build ``DFlashDraftModel`` from the folder's config (as SGLang does: ``AutoConfig``) and feed it the weights one by one.

    ``weights``: the folder's tensors, already read (a load's tensor is then one of them); read here if None.

    :returns: the model, its parameters by name, the names ``load_weights`` silently skipped, the ids
        of the parameters a loader was handed a tensor for, every load ``(param, tensor, shard_id)``,
        each layer's ``RadixAttention`` arguments and each layer's ``get_rope`` arguments.
    """
    from transformers import AutoConfig

    with sglang_dflash(wheel) as (module, recorder):
        config = AutoConfig.from_pretrained(str(folder))
        model = module.DFlashDraftModel(config)
        params = dict(model.named_parameters())
        skipped = []
        for name, tensor in (weight_files(folder) if weights is None else weights).items():
            before = len(recorder.loads)
            model.load_weights([(name, tensor)])
            if len(recorder.loads) == before:
                skipped.append(name)
        loaded = {id(p) for p, _, _ in recorder.loads}
        return model, params, skipped, loaded, recorder.loads, recorder.attentions, recorder.ropes
