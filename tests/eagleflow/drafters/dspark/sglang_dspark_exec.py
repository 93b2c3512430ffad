"""SGLang's DSpark draft model class and its Markov drafting, executed from a wheel's real source on CPU.

Built on DFlash's executor (``sglang_dflash_exec``: DSpark's class extends SGLang's ``DFlashDraftModel``), which
runs ``models/dflash.py`` and ``dflash_utils.py`` as they are with the rest of SGLang stubbed. Here these run
as they are too:

- ``srt/models/dspark.py``: ``DSparkDraftModel``, its Markov heads (``VanillaMarkov``, ``GatedMarkovHead``,
  ``RNNHead``), its confidence head, ``load_weights`` and ``compute_base_logits``;
- ``srt/speculative/dspark_components/dspark_config.py``: ``parse_dspark_draft_config``,
  ``resolve_runtime_config``;
- ``srt/speculative/ragged_verify.py``: the verify mode, read from a stand-in ``envs`` holding the value a
  server started with ``SGLANG_RAGGED_VERIFY_MODE`` would read;
- ``srt/speculative/dspark_components/dspark_draft.py``: ``draft_markov_block``, the drafting loop the worker
  runs, with ``kernels/ops/speculative/dspark/markov_sample.py`` (``MarkovSampleStep``) and
  ``dspark_draft_model.py`` (``MarkovGreedyStep``) taking their CPU path, the torch reference of their
  kernels. ``triton`` (CUDA only, not installed here) is a stand-in: the kernels' decorators and constants
  import, and none of them runs.

The stand-ins that matter: tensor-parallel size 1 (the vocabulary gather is the identity) and an unquantised
``lm_head`` (``should_apply_lm_head_quant_method`` is False), as on one GPU.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from sglang_exec import Inert
from sglang_wheels import Wheel

sys.path.append(str(Path(__file__).resolve().parents[1] / "dflash"))  # DSpark's SGLang class is built on DFlash's
from sglang_dflash_exec import (  # noqa: E402
    DFLASH, DFLASH_UTILS, DFlashRecorder, misrouted, sglang_dflash, weight_files, wheel_definition,
)

__all__ = ["ServedDSpark", "TargetHead", "load_into_sglang_dspark", "misrouted", "wheel_definition"]

DSPARK = "sglang/srt/models/dspark.py"
REAL_MODULES = {
    "sglang.srt.speculative.dflash_utils": DFLASH_UTILS,
    "sglang.srt.models.dflash": DFLASH,
    "sglang.srt.speculative.ragged_verify": "sglang/srt/speculative/ragged_verify.py",
    "sglang.srt.speculative.dspark_components.dspark_config": "sglang/srt/speculative/dspark_components/dspark_config.py",
    "sglang.kernels.ops.speculative.dspark.dispatch": "sglang/kernels/ops/speculative/dspark/dispatch.py",
    "sglang.kernels.ops.speculative.dspark.markov_sample": "sglang/kernels/ops/speculative/dspark/markov_sample.py",
    "sglang.kernels.ops.speculative.dspark.dspark_draft_model": "sglang/kernels/ops/speculative/dspark/dspark_draft_model.py",
    "sglang.srt.models.dspark": DSPARK,
    "sglang.srt.speculative.dspark_components.dspark_draft": "sglang/srt/speculative/dspark_components/dspark_draft.py",
}


class _Constexpr:
    """``triton.language.constexpr``: the kernels' module constants (``_NO_INDEX.value``) and annotations."""

    def __init__(self, value: Any) -> None:
        self.value = value


def triton_stand_in() -> dict[str, types.ModuleType]:
    """``triton``, ``triton.language`` and ``libdevice``: what the kernels' modules import at their top. ``cdiv`` is
    the one function their torch paths call."""
    # torch.compile (dflash.py's decorators) imports its compiler on first use, probing for triton: done before the
    # stand-in exists, it finds none, as on this machine.
    torch.compile(lambda x: x, backend="eager")
    for module in ("torch._functorch.aot_autograd", "torch._inductor.codecache"):
        importlib.import_module(module)

    modules: dict[str, types.ModuleType] = {}
    for name in ("triton", "triton.language", "triton.language.extra", "triton.language.extra.cann"):
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__getattr__ = lambda attribute: Inert()  # type: ignore[attr-defined]  # jit, autotune, libdevice …
        modules[name] = module
    modules["triton"].cdiv = lambda a, b: -(-a // b)  # type: ignore[attr-defined]
    modules["triton"].language = modules["triton.language"]  # type: ignore[attr-defined]
    modules["triton.language"].constexpr = _Constexpr  # type: ignore[attr-defined]
    return modules


def more_overrides(mode: str) -> Any:
    """The names DSpark's modules read whose value matters, for a server in verify mode ``mode``."""

    class Envs:
        def __getattr__(self, name: str) -> Any:  # every SGLANG_* flag at its default (off), the verify mode as given
            return types.SimpleNamespace(get=lambda: mode if name == "SGLANG_RAGGED_VERIFY_MODE" else False)

    def values(wheel: Wheel, recorder: DFlashRecorder) -> dict[str, Any]:
        return {
            "envs": Envs(),
            "tensor_model_parallel_all_gather": lambda tensor, dim=-1: tensor,  # one rank holds the whole vocabulary
            "should_apply_lm_head_quant_method": lambda lm_head, method: False,
        }

    return values


class TargetHead(nn.Module):
    """The target's ``lm_head`` as SGLang's ``ParallelLMHead`` holds it on one GPU: its weight, unquantised."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.org_vocab_size = weight.shape[0]
        self.quant_method = None
        self.tp_size = 1


@dataclass
class ServedDSpark:
    """What the pinned wheel's ``DSparkDraftModel`` built from a folder, how its ``load_weights`` took the file, and
    the wheel's own DSpark functions (``dspark_config``, ``dspark_draft``) to run against it."""

    model: nn.Module
    params: dict[str, nn.Parameter]
    skipped: list[str]
    loaded: set[int]
    loads: list
    attentions: list[dict[str, Any]]
    config: Any  # what AutoConfig made of the folder's config.json
    dspark_config: types.ModuleType
    dspark_draft: types.ModuleType
    dspark_model: types.ModuleType


def load_into_sglang_dspark(
    wheel: Wheel, folder: Path, mode: str = "cap-accept", weights: Mapping[str, torch.Tensor] | None = None
) -> ServedDSpark:
    """Build ``DSparkDraftModel`` from the folder's config (as SGLang does: ``AutoConfig``) for a server in verify
    ``mode`` (``static`` builds no confidence head), and feed it the weights one by one (``weights``: the folder's,
    already read; read here if None)."""
    from transformers import AutoConfig

    with sglang_dflash(wheel, REAL_MODULES, more_overrides(mode), triton_stand_in()) as (_, recorder):
        modules = {name: sys.modules[name] for name in REAL_MODULES}
        config = AutoConfig.from_pretrained(str(folder))
        dspark = modules["sglang.srt.models.dspark"]
        model = dspark.DSparkDraftModel(config)
        params = dict(model.named_parameters())
        tensors = weight_files(folder) if weights is None else weights
        # In one call, as the model loader makes it: the confidence head's loader refuses a call that lacks its tensors.
        model.load_weights(list(tensors.items()))
        handed = {id(t) for _, t, _ in recorder.loads}
        skipped = [name for name, t in tensors.items() if id(t) not in handed]
        return ServedDSpark(
            model, params, skipped, {id(p) for p, _, _ in recorder.loads}, recorder.loads, recorder.attentions, config,
            modules["sglang.srt.speculative.dspark_components.dspark_config"],
            modules["sglang.srt.speculative.dspark_components.dspark_draft"], dspark,
        )
