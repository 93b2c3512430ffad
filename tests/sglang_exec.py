"""SGLang's EAGLE-3 draft model class, executed from a wheel's real source on CPU.

``sglang/srt/models/llama_eagle3.py`` and the ``llama.py`` it builds on run as they are; every
other ``sglang.*`` module they import is replaced by stand-ins: layers that own a ``weight``
(linear, norm, embedding and LM-head classes, whose real versions hold one weight, and a ``bias``
when built with ``bias=True``) become modules with one empty weight (and bias) whose loader
records what reached it; ``get_rope`` records the arguments the attention builds it with;
the few functions whose value matters are given the value a single-GPU server has (world size 1,
rank 0, last pipeline rank, no draft window); everything else is an inert object. So the module
tree, the parameter names, the config the class reads and ``load_weights`` are SGLang's own.
"""

from __future__ import annotations

import ast
import contextlib
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sglang_wheels import Wheel

EAGLE3 = "sglang/srt/models/llama_eagle3.py"
LLAMA = "sglang/srt/models/llama.py"
WEIGHTED_SUFFIXES = ("Linear", "Norm", "Embedding", "LMHead")


class _InertType(type):
    def __getattr__(cls, name: str) -> Inert:  # class attributes too (an enum member, a constant)
        if name.startswith("__"):
            raise AttributeError(name)
        return Inert()


class Inert(metaclass=_InertType):
    """Any name of a stubbed module: callable, subscriptable, a context manager, a base class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Inert:
        return Inert()

    def __getattr__(self, name: str) -> Inert:
        return Inert()

    def __getitem__(self, key: Any) -> Inert:
        return Inert()

    def __enter__(self) -> Inert:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __bool__(self) -> bool:
        return False


class LoadRecorder:
    """What SGLang's ``load_weights`` handed to each parameter's loader."""

    def __init__(self) -> None:
        self.loads: list[tuple[nn.Parameter, Any, Any]] = []
        self.ropes: list[dict[str, Any]] = []  # get_rope's arguments, one call per attention layer

    def get_rope(self, head_size: int, rotary_dim: int, max_position: int, base: float, **kwargs: Any) -> Inert:
        self.ropes.append(dict(head_size=head_size, rotary_dim=rotary_dim, max_position=max_position, base=base, **kwargs))
        return Inert()

    def loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        self.loads.append((param, loaded, shard_id))


def weighted_layer(recorder: LoadRecorder) -> type[nn.Module]:
    class Weighted(nn.Module):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.empty(0), requires_grad=False)
            self.weight.weight_loader = recorder.loader  # type: ignore[attr-defined]
            if kwargs.get("bias") is True:
                self.bias = nn.Parameter(torch.empty(0), requires_grad=False)
                self.bias.weight_loader = recorder.loader  # type: ignore[attr-defined]

    return Weighted


def stub_value(name: str, recorder: LoadRecorder) -> Any:
    """The stand-in for ``name`` imported from a stubbed sglang module."""
    if name.endswith(WEIGHTED_SUFFIXES):
        return weighted_layer(recorder)
    single_gpu = types.SimpleNamespace(is_first_rank=True, is_last_rank=True, world_size=1, rank_in_group=0)
    values: dict[str, Any] = {
        "add_prefix": lambda name, prefix: f"{prefix}.{name}" if prefix else name,
        "default_weight_loader": recorder.loader,
        "get_pp_group": lambda: single_gpu,
        "get_parallel": lambda: types.SimpleNamespace(pp_group=single_gpu, tp_size=1, tp_rank=0),
        "get_spec": lambda: types.SimpleNamespace(speculative_draft_window_size=None),
        "get_rope": recorder.get_rope,
        "layer_stack": contextlib.nullcontext,
    }
    if name in values:
        return values[name]
    if name.startswith("is_"):
        return lambda *args, **kwargs: False
    if name.startswith("get_") and ("world_size" in name or name.endswith("_size")):
        return lambda *args, **kwargs: 1
    if name.startswith("get_") and "rank" in name:
        return lambda *args, **kwargs: 0
    return Inert


class StubModule(types.ModuleType):
    def __init__(self, name: str, recorder: LoadRecorder) -> None:
        super().__init__(name)
        self.__path__: list[str] = []  # a package, so submodules import
        self._recorder = recorder

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return stub_value(name, self._recorder)


def imported_sglang_modules(wheel: Wheel, names: tuple[str, ...]) -> set[str]:
    found: set[str] = set()
    for name in names:
        for node in ast.walk(wheel.tree(name)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang"):
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names if a.name.startswith("sglang"))
    return found


@contextlib.contextmanager
def sglang_eagle3(wheel: Wheel) -> Iterator[tuple[types.ModuleType, LoadRecorder]]:
    """``llama_eagle3`` of ``wheel`` as a module (and the recorder of its weight loads), for the ``with`` block."""
    recorder = LoadRecorder()
    real = {"sglang.srt.models.llama": LLAMA, "sglang.srt.models.llama_eagle3": EAGLE3}
    saved = {name: module for name, module in sys.modules.items() if name == "sglang" or name.startswith("sglang.")}
    try:
        for name in sorted(imported_sglang_modules(wheel, (EAGLE3, LLAMA)) | {"sglang", "sglang.srt", "sglang.srt.models"}):
            parts = name.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                if prefix not in real:
                    sys.modules.setdefault(prefix, StubModule(prefix, recorder))
        for name in ("sglang.srt.models.llama", "sglang.srt.models.llama_eagle3"):
            module = types.ModuleType(name)
            module.__file__ = f"{wheel.path}/{real[name]}"
            sys.modules[name] = module
            exec(compile(wheel.text(real[name]), real[name], "exec"), module.__dict__)
        yield sys.modules["sglang.srt.models.llama_eagle3"], recorder
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def load_into_sglang(wheel: Wheel, sglang_folder: Path) -> tuple[object, dict[str, torch.nn.Parameter], list[str], set[int], list]:
    """Build SGLang's class from the folder and feed it the weights one by one; report what happened."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    with sglang_eagle3(wheel) as (module, recorder):
        config = AutoConfig.from_pretrained(str(sglang_folder))
        model = module.LlamaForCausalLMEagle3(config)
        params = dict(model.named_parameters())
        skipped = []
        for name, tensor in load_file(str(sglang_folder / "model.safetensors")).items():
            before, hot = len(recorder.loads), model.hot_token_id
            model.load_weights([(name, tensor)])
            if len(recorder.loads) == before and model.hot_token_id is hot:
                skipped.append(name)
        return model, params, skipped, {id(p) for p, _, _ in recorder.loads}, recorder.loads


def sglang_ropes(wheel: Wheel, sglang_folder: Path) -> list[dict[str, Any]]:
    """The arguments each draft layer's attention builds its rotary embedding with (``get_rope``), for the folder."""
    from transformers import AutoConfig

    with sglang_eagle3(wheel) as (module, recorder):
        module.LlamaForCausalLMEagle3(AutoConfig.from_pretrained(str(sglang_folder)))
        return list(recorder.ropes)
