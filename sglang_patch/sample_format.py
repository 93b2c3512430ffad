"""The storage dtypes a hidden-state sample file comes in, by name (standard library only).

``bf16`` stores the states as the model computes them; ``fp8`` stores float8_e4m3fn values
with one float32 scale per token, what speculators 0.9's ``--hidden-states-backend fp8``
reads, in about half the bytes. The tensors of each are :mod:`sglang_patch.sample_file`'s;
this module holds only the names (the storage dtypes, the file's tensor keys, a row's file
name) and the bytes a token takes, so the Params form, the step configs, header checks and size
estimates can use them without importing torch.
"""

from __future__ import annotations

from typing import Literal, get_args

HiddenStatesDtype = Literal["bf16", "fp8"]
HIDDEN_STATES_DTYPES: tuple[str, ...] = get_args(HiddenStatesDtype)
DEFAULT_HIDDEN_STATES_DTYPE: HiddenStatesDtype = "bf16"

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
SCALES_KEY = "hidden_states_scales"


# Bytes per element of what a file stores per token: the states in each storage dtype, the int64
# token id, and fp8's float32 scale. sample_file checks them against its torch dtypes; kept here
# so the size of a dataset is known without importing torch (dataset-stats, the disk checks).
STATE_ELEMENT_BYTES: dict[str, int] = {"bf16": 2, "fp8": 1}
TOKEN_ID_BYTES = 8
SCALE_BYTES = 4


def check_hidden_states_dtype(name: str) -> HiddenStatesDtype:
    """``name`` if it is a storage dtype, else ValueError listing the choices."""
    if name not in HIDDEN_STATES_DTYPES:
        raise ValueError(f"hidden-states dtype {name!r} is not one of {list(HIDDEN_STATES_DTYPES)}")
    return name  # type: ignore[return-value]


def sample_file_name(row: int) -> str:
    """File name of dataset row ``row`` inside ``<dataset>/hidden_states/``."""
    return f"hs_{row}.safetensors"


def bytes_per_token(n_slots: int, hidden: int, hidden_states_dtype: HiddenStatesDtype) -> int:
    """Bytes one token takes in a file: its states, its token id and (fp8) its scale.

    The safetensors header (a few hundred bytes per file) comes on top.
    """
    dtype = check_hidden_states_dtype(hidden_states_dtype)
    size = n_slots * hidden * STATE_ELEMENT_BYTES[dtype] + TOKEN_ID_BYTES
    return size + SCALE_BYTES if dtype == "fp8" else size


def sample_file_bytes(seq_len: int, n_slots: int, hidden: int, hidden_states_dtype: HiddenStatesDtype = "bf16") -> int:
    """Bytes of one sample's tensors (:func:`bytes_per_token` × ``seq_len``; the header comes on top)."""
    return seq_len * bytes_per_token(n_slots, hidden, hidden_states_dtype)
