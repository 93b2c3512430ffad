"""The fp8 quantiser of the sample format: hs-connectors' own bytes, a chunk of tokens at a time.

hs-connectors is the reference (``fp8_utils.quantize_tensor_to_fp8``, what speculators' fp8
backend is paired with); sglang_patch cannot import it inside the server, so these tests hold its
quantiser against the real one on the same states, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hs_connectors.fp8_utils import quantize_tensor_to_fp8

from sglang_patch import sample_file
from sglang_patch.sample_file import quantize_fp8, quantize_fp8_into

SLOTS, HIDDEN = 4, 7168  # Kimi-K2.5's shape: one scale spans 4 × 7168 values


def hard_states(seq: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """States whose tokens span the dtype's range, with the cases a quantiser gets wrong first."""
    generator = torch.Generator().manual_seed(seed)
    low, high = (-9, 4) if dtype == torch.float16 else (-35, 35)
    magnitudes = torch.logspace(low, high, seq, dtype=torch.float64).view(-1, 1, 1)
    states = (torch.randn(seq, SLOTS, HIDDEN, generator=generator, dtype=torch.float64) * magnitudes).to(dtype)
    states[0] = 0.0  # an all-zero token still gets a usable scale (the 1e-12 clamp)
    states[1] = -0.0  # negative zeros stay negative zeros
    states[2, :, :] = torch.finfo(dtype).tiny / 4  # subnormal inputs
    states[3] = states[3] * 1e-3
    states[3, 2, 17] = -torch.finfo(dtype).max / 2  # one value in one slot sets the whole token's scale
    return states


def same_bytes(ours: tuple[torch.Tensor, torch.Tensor], theirs: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_equals_hs_connectors_bit_for_bit_across_chunk_boundaries(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    states = hard_states(23, dtype)
    before = states.clone()
    reference = quantize_tensor_to_fp8(states)
    assert same_bytes(quantize_fp8(states), reference)  # the default chunking
    # Five tokens a chunk: 23 tokens end in a partial chunk, and a token never straddles two.
    monkeypatch.setattr(sample_file, "_CHUNK_ELEMENTS_CPU", 5 * SLOTS * HIDDEN + 7)
    assert same_bytes(quantize_fp8(states), reference)
    assert torch.equal(states.view(torch.uint8), before.view(torch.uint8)), "the input is left alone"


def test_quantising_into_given_buffers_returns_every_slots_verdict() -> None:
    states = hard_states(9, torch.bfloat16)
    values = torch.empty(states.shape, dtype=torch.float8_e4m3fn)
    scales = torch.empty(9, 1, 1)
    finite = quantize_fp8_into(states, values, scales)
    assert finite.tolist() == [True] * SLOTS
    assert same_bytes((values, scales), quantize_tensor_to_fp8(states))

    states[4, 1, 3] = float("nan")
    states[6, 3, 0] = float("-inf")
    finite = quantize_fp8_into(states, values, scales)
    assert finite.tolist() == [True, False, True, False]
    assert (~torch.isfinite(scales.flatten())).nonzero().flatten().tolist() == [4, 6]


def test_wrong_buffers_are_refused_before_any_work() -> None:
    states = torch.zeros(3, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="values must be"):
        quantize_fp8_into(states, torch.empty(3, 2, 8, dtype=torch.bfloat16), torch.empty(3, 1, 1))
    with pytest.raises(ValueError, match="scales must be"):
        quantize_fp8_into(states, torch.empty(3, 2, 8, dtype=torch.float8_e4m3fn), torch.empty(3, 1))
    with pytest.raises(ValueError, match="cannot quantise torch.float64"):
        quantize_fp8(states.double())
