"""The per-sample hidden-state file (DESIGN.md §3.2): the one definition of its format.

``hidden_states``: ``[seq_len, n_slots, hidden]`` in the model dtype (bf16), slots = aux layer ids
in order, then the last layer's output before the final norm; ``token_ids``: ``[seq_len]`` int64.
This is exactly what ``speculators`` reads (``hs_connectors.FileTransfer``).

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

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
HIDDEN_STATES_DTYPE = torch.bfloat16
TOKEN_IDS_DTYPE = torch.int64


def sample_file_name(row: int) -> str:
    """File name of dataset row ``row`` inside ``<dataset>/hidden_states/``."""
    return f"hs_{row}.safetensors"


def write_sample_file(path: str | os.PathLike[str], hidden_states: torch.Tensor, token_ids: torch.Tensor) -> Path:
    """Write one sample atomically: temp file in the same folder, fsync, rename.

    A reader therefore sees either no file or a complete one; a write killed midway leaves
    only a dot-named ``.tmp`` file that no reader globs for.
    """
    path = Path(path)
    if hidden_states.dim() != 3:
        raise ValueError(f"hidden_states must be [seq_len, n_slots, hidden], got shape {tuple(hidden_states.shape)}")
    if token_ids.dim() != 1 or token_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(
            f"token_ids must be [seq_len={hidden_states.shape[0]}], got shape {tuple(token_ids.shape)}"
        )
    tensors = {
        HIDDEN_STATES_KEY: hidden_states.detach().to("cpu", HIDDEN_STATES_DTYPE).contiguous(),
        TOKEN_IDS_KEY: token_ids.detach().to("cpu", TOKEN_IDS_DTYPE).contiguous(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp_name)
        os.chmod(tmp_name, published_file_mode())  # mkstemp makes 0600; the extractor may be another user
        with open(tmp_name, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return path
