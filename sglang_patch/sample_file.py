"""The per-sample hidden-state file (DESIGN.md §3.2): the one definition of its format.

Every file holds ``hidden_states [seq_len, n_slots, hidden]`` (slots = aux layer ids in order,
then the last layer's output before the final norm) and ``token_ids [seq_len]`` int64, in one
of two storage dtypes (:mod:`sglang_patch.sample_format`):

- ``bf16``: the states in bf16, what ``speculators`` reads with its ``file`` backend
  (``hs_connectors.FileTransfer``);
- ``fp8``: the states as float8_e4m3fn plus ``hidden_states_scales [seq_len, 1, 1]`` float32,
  one scale per token over all slots, what speculators 0.9 reads with ``--hidden-states-backend
  fp8`` (``hs_connectors.FP8Transfer``: ``fp8.to(bf16) * scale.to(bf16)``). The quantisation is
  hs-connectors' own (``fp8_utils.quantize_tensor_to_fp8``): ``scale = max(amax / 448, 1e-12)``,
  ``fp8 = (x.float() / scale).to(float8_e4m3fn)``, the same bytes.

Self-contained (standard library, torch, safetensors): it is imported inside the SGLang server
by the capture hook as well as by eagleflow's sample store.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from sglang_patch.file_mode import published_file_mode
from sglang_patch.sample_format import HIDDEN_STATES_DTYPES, HiddenStatesDtype, check_hidden_states_dtype

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
SCALES_KEY = "hidden_states_scales"
TOKEN_IDS_DTYPE = torch.int64
SCALES_DTYPE = torch.float32
STORAGE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
FP8_MIN_SCALE = 1e-12  # hs-connectors' clamp: an all-zero token still gets a usable scale
assert set(STORAGE_DTYPES) == set(HIDDEN_STATES_DTYPES), "every named storage dtype needs its torch dtype"


def sample_file_name(row: int) -> str:
    """File name of dataset row ``row`` inside ``<dataset>/hidden_states/``."""
    return f"hs_{row}.safetensors"


def sample_keys(hidden_states_dtype: HiddenStatesDtype) -> set[str]:
    """The tensors a file of that storage dtype holds, no more, no less."""
    keys = {HIDDEN_STATES_KEY, TOKEN_IDS_KEY}
    return keys | {SCALES_KEY} if hidden_states_dtype == "fp8" else keys


def storage_dtype_of(tensor_dtype: torch.dtype) -> HiddenStatesDtype | None:
    """Which storage dtype a file's ``hidden_states`` tensor dtype belongs to (None: neither)."""
    for name, dtype in STORAGE_DTYPES.items():
        if dtype == tensor_dtype:
            return name  # type: ignore[return-value]
    return None


def bytes_per_token(n_slots: int, hidden: int, hidden_states_dtype: HiddenStatesDtype) -> int:
    """Bytes one token takes in a file: its states, its token id and (fp8) its scale.

    The safetensors header (a few hundred bytes per file) comes on top.
    """
    dtype = check_hidden_states_dtype(hidden_states_dtype)
    size = n_slots * hidden * STORAGE_DTYPES[dtype].itemsize + TOKEN_IDS_DTYPE.itemsize
    return size + SCALES_DTYPE.itemsize if dtype == "fp8" else size


def quantize_fp8(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8 states, float32 scales [seq_len, 1, 1])`` on the states' own device.

    Byte-identical to hs-connectors' ``quantize_tensor_to_fp8``; the per-token maximum is
    taken on the input dtype (exact) and the division done in place, so the only float32
    temporary is one copy of the states.
    """
    fp8 = STORAGE_DTYPES["fp8"]
    reduce_dims = tuple(range(1, hidden_states.dim()))
    amax = hidden_states.detach().abs().amax(dim=reduce_dims, keepdim=True).float()
    scales = (amax / torch.finfo(fp8).max).clamp(min=FP8_MIN_SCALE)
    values = hidden_states.detach().to(torch.float32, copy=True)  # a copy even of float32 states: divided in place
    values.div_(scales)
    return values.to(fp8), scales


def encode_hidden_states(hidden_states: torch.Tensor, hidden_states_dtype: HiddenStatesDtype) -> dict[str, torch.Tensor]:
    """The file's state tensors for ``hidden_states`` (any float dtype), on its own device.

    Run it where the states are (the GPU in a server): an fp8 file then crosses to the host
    at half the bytes of bf16.
    """
    dtype = check_hidden_states_dtype(hidden_states_dtype)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(hidden_states.shape)}")
    if dtype == "fp8":
        values, scales = quantize_fp8(hidden_states)
        return {HIDDEN_STATES_KEY: values, SCALES_KEY: scales}
    return {HIDDEN_STATES_KEY: hidden_states.detach().to(STORAGE_DTYPES[dtype])}


def decode_hidden_states(tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The states of a loaded file in ``dtype``, dequantised the way speculators does for fp8."""
    states = tensors[HIDDEN_STATES_KEY]
    if SCALES_KEY in tensors:
        return states.to(dtype) * tensors[SCALES_KEY].to(dtype)
    return states.to(dtype)


def write_sample_file(
    path: str | os.PathLike[str],
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    hidden_states_dtype: HiddenStatesDtype = "bf16",
) -> Path:
    """Encode ``hidden_states`` in ``hidden_states_dtype`` and write one sample atomically."""
    tensors = {k: v.to("cpu") for k, v in encode_hidden_states(hidden_states, hidden_states_dtype).items()}
    return write_encoded_sample(path, {**tensors, TOKEN_IDS_KEY: token_ids})


def write_encoded_sample(path: str | os.PathLike[str], tensors: dict[str, torch.Tensor]) -> Path:
    """Write host tensors made by :func:`encode_hidden_states` plus ``token_ids``: temp file, fsync, rename.

    A reader therefore sees either no file or a complete one; a write killed midway leaves
    only a dot-named ``.tmp`` file that no reader globs for.
    """
    path = Path(path)
    states, token_ids = tensors[HIDDEN_STATES_KEY], tensors[TOKEN_IDS_KEY]
    stored = storage_dtype_of(states.dtype)
    if stored is None or set(tensors) != sample_keys(stored):
        raise ValueError(f"not an encoded sample: hidden_states {states.dtype}, tensors {sorted(tensors)}")
    if states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(states.shape)}")
    if token_ids.dim() != 1 or token_ids.shape[0] != states.shape[0]:
        raise ValueError(f"token_ids must be [seq_len={states.shape[0]}], got shape {tuple(token_ids.shape)}")
    scales = tensors.get(SCALES_KEY)
    if scales is not None and (scales.dtype != SCALES_DTYPE or tuple(scales.shape) != (states.shape[0], 1, 1)):
        raise ValueError(f"{SCALES_KEY} must be [seq_len={states.shape[0]}, 1, 1] float32, got {scales.dtype} {tuple(scales.shape)}")
    out = {key: value.detach().contiguous() for key, value in tensors.items()}
    out[TOKEN_IDS_KEY] = token_ids.detach().to("cpu", TOKEN_IDS_DTYPE).contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(out, tmp_name)
        os.chmod(tmp_name, published_file_mode())  # mkstemp makes 0600; the extractor may be another user
        with open(tmp_name, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path
