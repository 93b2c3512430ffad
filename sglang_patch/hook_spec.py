"""What the launcher tells SGLang about the capture hook: supported versions and the hook spec.

SGLang (``sglang/srt/model_executor/hook_manager.py``) takes ``--forward-hooks '<json list>'``
of ``{"name", "target_modules", "hook_factory", "config"}``; it imports the factory named here
in every model-runner process and registers what it returns as a post forward hook on every
module whose qualified name matches a ``target_modules`` pattern. This module builds that
spec and owns the supported version range; :mod:`sglang_patch.hook` is the code that then
runs inside the server. Standard library only, so the launcher imports it without torch.

Supported SGLang: ``>=0.5.10,<0.5.24`` (:data:`SUPPORTED_RANGE`), in two layer-boundary APIs
(:data:`LAYER_BOUNDARY_APIS`; :mod:`sglang_patch.layer_output` reads each). Checked against the
wheels by ``tests/sglang_patch/test_sglang_source.py``:

- 0.5.10 is the first release whose ForwardBatch carries ``rids`` (forward_batch_info.py);
  before it the hook cannot tell which request a token belongs to.
- 0.5.10-0.5.20: every DeepSeek-V2/V3 decoder layer is called as ``layer(positions,
  hidden_states, forward_batch, residual, ...)`` and returns ``(hidden_states, residual,
  topk_indices)``.
- 0.5.21-0.5.23: the layer lost ``residual`` and returns ``(hidden_states, topk_indices)``; the
  residual lives in ``forward_batch.residual_stream`` and SGLang's ``residual.batch.snapshot``
  gives ``hidden + residual``.
- 0.5.24 is not supported until its wheel has been read: the layer-boundary package changes
  from release to release.

Kimi-K2.5 (KimiK25ForConditionalGeneration) wraps the same DeepseekV3ForCausalLM as
``language_model`` throughout.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from sglang_patch.layer_ids import validate_aux_layer_ids
from sglang_patch.sample_format import DEFAULT_HIDDEN_STATES_DTYPE, HiddenStatesDtype, check_hidden_states_dtype

SUPPORTED_MIN = (0, 5, 10)
SUPPORTED_BELOW = (0, 5, 24)
SUPPORTED_RANGE = ">=0.5.10,<0.5.24"

LAYER_TUPLE = "layer_tuple"
RESIDUAL_STREAM = "residual_stream"
# (first release, API) in release order: each API holds up to the next entry's first release.
LAYER_BOUNDARY_APIS = (((0, 5, 10), LAYER_TUPLE), ((0, 5, 21), RESIDUAL_STREAM))

HOOK_NAME = "eagleflow_hidden_states"
HOOK_FACTORY = "sglang_patch.hook:capture_hook_factory"
DUMP_DIR_ENV = "SGLANG_HS_DUMP_DIR"

# Where the DeepseekV2Model sits in SGLang's module tree:
# DeepseekV3ForCausalLM.model (DeepSeek-V3) and
# KimiK25ForConditionalGeneration.language_model.model (Kimi-K2.5, a multimodal wrapper).
DEEPSEEK_V3_MODEL_PREFIX = "model"
KIMI_K25_MODEL_PREFIX = "language_model.model"
MODEL_PREFIXES = (DEEPSEEK_V3_MODEL_PREFIX, KIMI_K25_MODEL_PREFIX)


class UnsupportedSGLangVersion(RuntimeError):
    """The installed SGLang is outside :data:`SUPPORTED_RANGE`; carries the version found."""

    def __init__(self, version: str, detail: str = "") -> None:
        self.version = version
        why = detail or (
            "Below 0.5.10 ForwardBatch has no rids (no way to name a request's dump); releases from "
            f"{'.'.join(map(str, SUPPORTED_BELOW))} on have a layer-boundary API whose source the hook has not been checked against"
        )
        super().__init__(
            f"eagleflow's hidden-state capture hook supports sglang {SUPPORTED_RANGE}, found sglang "
            f"{version!r}. {why}. Install a supported release, e.g. pip install 'sglang{SUPPORTED_RANGE}'."
        )


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; raises ValueError for text without a x.y.z start."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def is_supported_version(version: str) -> bool:
    """Whether SGLang ``version`` lies in :data:`SUPPORTED_RANGE`."""
    try:
        parsed = parse_version(version)
    except ValueError:
        return False
    return SUPPORTED_MIN <= parsed < SUPPORTED_BELOW


def check_supported_version(version: str) -> None:
    """Raise :class:`UnsupportedSGLangVersion` unless ``version`` is supported."""
    if not is_supported_version(version):
        raise UnsupportedSGLangVersion(version)


def layer_boundary_api(version: str) -> str:
    """:data:`LAYER_TUPLE` or :data:`RESIDUAL_STREAM`: how SGLang ``version`` hands a layer's output over."""
    check_supported_version(version)
    parsed = parse_version(version)
    return [api for since, api in LAYER_BOUNDARY_APIS if parsed >= since][-1]


def target_module_names(aux_layer_ids: Sequence[int], num_layers: int) -> list[str]:
    """The module names the hook must be registered on, for DeepSeek-V3 and Kimi-K2.5 trees.

    ``embed_tokens`` for id 0, layer k-1 for id k >= 1, and the last layer for the final slot.
    They are exact names (fnmatch patterns without wildcards), so ``layers.2`` never matches
    ``layers.20``; the names of the layout a model does not have simply match nothing.
    """
    ids = validate_aux_layer_ids(aux_layer_ids, num_layers)
    layers = sorted({k - 1 for k in ids if k >= 1} | {num_layers - 1})
    names: list[str] = []
    for prefix in MODEL_PREFIXES:
        if 0 in ids:
            names.append(f"{prefix}.embed_tokens")
        names += [f"{prefix}.layers.{i}" for i in layers]
    return names


def forward_hooks_spec(
    aux_layer_ids: Sequence[int],
    num_layers: int,
    dump_dir: str | os.PathLike[str] | None = None,
    hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
) -> list[dict[str, Any]]:
    """The ``--forward-hooks`` value (a JSON list) that switches the capture on."""
    config: dict[str, Any] = {
        "aux_layer_ids": validate_aux_layer_ids(aux_layer_ids, num_layers),
        "num_layers": num_layers,
        "hidden_states_dtype": check_hidden_states_dtype(hidden_states_dtype),
    }
    if dump_dir is not None:
        config["dump_dir"] = str(dump_dir)
    return [
        {
            "name": HOOK_NAME,
            "target_modules": target_module_names(aux_layer_ids, num_layers),
            "hook_factory": HOOK_FACTORY,
            "config": config,
        }
    ]


def forward_hooks_argument(
    aux_layer_ids: Sequence[int],
    num_layers: int,
    dump_dir: str | os.PathLike[str] | None = None,
    hidden_states_dtype: HiddenStatesDtype = DEFAULT_HIDDEN_STATES_DTYPE,
) -> str:
    """:func:`forward_hooks_spec` as the one argv element SGLang's ``json_list_type`` parses."""
    spec = forward_hooks_spec(aux_layer_ids, num_layers, dump_dir, hidden_states_dtype)
    return json.dumps(spec, separators=(",", ":"))
