"""Whether captured states hold only finite values, checked where the tensor already is.

On a GPU the check is one reduction on the device, queued on the current stream: nothing
waits for it; the writer reads the verdict after the copy's event. On the CPU,
``torch.isfinite`` runs at ~0.1 GB/s on bf16, slower than a disk: bf16/fp16 are checked as
integers instead (a value is NaN/Inf exactly when its exponent bits are all ones), in
cache-sized chunks, at several GB/s. States stored as fp8 need no check of their own: the
quantiser's per-token maxima already say it, on either device
(:func:`sglang_patch.sample_file.quantize_fp8_into`). The verdict is written into the file's
metadata, so the extractor never reads the states back.

Standard library, torch and numpy (torch's own dependency) only: runs inside the SGLang server.
"""

from __future__ import annotations

from typing import Any

import torch

# Exponent bits all ones <=> NaN or Inf. Shifted left by one (dropping the sign), the uint16
# value is >= this bound exactly then.
_NONFINITE_FROM = {torch.bfloat16: 0xFF00, torch.float16: 0xF800}
_CHUNK = 1 << 18  # elements per step: two 512 KB buffers stay in the CPU cache


def finite_on_device(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor on ``tensor``'s device: True when every value is finite (no sync)."""
    return torch.isfinite(tensor).all()


def all_finite_cpu(tensor: torch.Tensor) -> bool:
    """Whether a CPU tensor holds only finite values (fast for bf16 and fp16)."""
    bound = _NONFINITE_FROM.get(tensor.dtype)
    if bound is None or not tensor.is_contiguous():
        return bool(torch.isfinite(tensor).all())
    import numpy as np

    bits = tensor.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    scratch = np.empty(min(_CHUNK, bits.size), dtype=np.uint16)
    for start in range(0, bits.size, _CHUNK):
        piece = bits[start : start + _CHUNK]
        out = scratch[: piece.size]
        np.left_shift(piece, 1, out=out)
        if int(out.max()) >= bound:
            return False
    return True


def nonfinite_report(states: Any, slot_axis: int) -> str:
    """Where the NaN/Inf values are, for an error message (slow; only for a failed check)."""
    states = states.float()
    other = [axis for axis in range(states.dim()) if axis != slot_axis]
    bad = ~torch.isfinite(states)
    slots = [int(s) for s in bad.any(dim=other[1]).any(dim=other[0]).nonzero().flatten().tolist()] if len(other) == 2 else []
    return f"non-finite values: {int(torch.isnan(states).sum())} NaN, {int(torch.isinf(states).sum())} Inf in slots {slots}"


def nonfinite_slots_report(slots_finite: torch.Tensor, scales: torch.Tensor) -> str:
    """Where the NaN/Inf values were, for states quantised where they were computed.

    Only the quantiser's per-slot verdict and the per-token scales came to the host (a token
    holding a NaN or an Inf gets a non-finite scale), so the report names slots and tokens, not counts.
    """
    slots = [int(s) for s in (~slots_finite.reshape(-1)).nonzero().flatten().tolist()]
    tokens = (~torch.isfinite(scales.reshape(-1))).nonzero().flatten().tolist()
    shown = ", ".join(str(int(t)) for t in tokens[:10]) + (f" and {len(tokens) - 10} more" if len(tokens) > 10 else "")
    return f"non-finite values (NaN or Inf) in slots {slots}, {len(tokens)} token(s): {shown}"
