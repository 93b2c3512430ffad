"""What the block drafters' decoding tests share: the trained tiny verifier as their target, and a few prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TEXTS = ["hello there, how are you", "the cat sat on", "1 2 3 4", "Tell me a story about a dragon."]


@pytest.fixture(scope="module")
def target(tiny_model: Path) -> tuple[Any, Any]:
    """The trained tiny verifier in float32 (greedy decoding has one answer however the passes are grouped), its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(str(tiny_model))


@pytest.fixture(scope="module")
def prompts(target: tuple[Any, Any]) -> list[list[int]]:
    return [target[1](text)["input_ids"] for text in TEXTS]
