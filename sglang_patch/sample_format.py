"""The storage dtypes a hidden-state sample file comes in, by name (standard library only).

``bf16`` stores the states as the model computes them; ``fp8`` stores float8_e4m3fn values
with one float32 scale per token, what speculators 0.9's ``--hidden-states-backend fp8``
reads, in about half the bytes. The tensors of each are :mod:`sglang_patch.sample_file`'s;
this module holds only the names (the storage dtypes, the file's tensor keys, a row's file
name), so the Params form, the step configs and header checks can use them without importing torch.
"""

from __future__ import annotations

from typing import Literal, get_args

HiddenStatesDtype = Literal["bf16", "fp8"]
HIDDEN_STATES_DTYPES: tuple[str, ...] = get_args(HiddenStatesDtype)
DEFAULT_HIDDEN_STATES_DTYPE: HiddenStatesDtype = "bf16"

HIDDEN_STATES_KEY = "hidden_states"
TOKEN_IDS_KEY = "token_ids"
SCALES_KEY = "hidden_states_scales"


def check_hidden_states_dtype(name: str) -> HiddenStatesDtype:
    """``name`` if it is a storage dtype, else ValueError listing the choices."""
    if name not in HIDDEN_STATES_DTYPES:
        raise ValueError(f"hidden-states dtype {name!r} is not one of {list(HIDDEN_STATES_DTYPES)}")
    return name  # type: ignore[return-value]


def sample_file_name(row: int) -> str:
    """File name of dataset row ``row`` inside ``<dataset>/hidden_states/``."""
    return f"hs_{row}.safetensors"
