"""The reference drafter's rotary embedding against SGLang's own rotary code, run from the wheels.

SGLang's rotary classes need CUDA kernels to be built whole, so their methods are taken from the
wheel's source (``base.RotaryEmbedding``: ``_compute_inv_freq``, ``_compute_cos_sin_cache``,
``forward_native``; ``rope_variant.Llama3RotaryEmbedding``; ``yarn.YaRNScalingRotaryEmbedding``,
its helpers and ``utils.apply_rotary_emb``) and assembled into classes with the same bases; a
stand-in ``__init__`` of the base sets what SGLang's sets before it computes the cache. The
arguments each class gets are ``factory.get_rope``'s for the settings. Queries and keys rotated by
that code must equal :class:`~eagleflow.sglang_rules.rope.Rotary`'s, including the cases
training never produces (a partial rotary, GPT-J style) which the reference drafter still serves
as SGLang would.
"""

from __future__ import annotations

import ast
import math
import types
import typing
from typing import Any

import pytest
import torch

from eagleflow.sglang_rules import UnsupportedRope, sglang_rotary
from sglang_wheels import Wheel, find_class, get_wheel, pinned_version

pytestmark = pytest.mark.sglang_source

ROPE = "sglang/srt/layers/rotary_embedding/"
VERSIONS = sorted({"0.5.17", "0.5.20", "0.5.23", pinned_version()})
HEAD_DIM = 16


def _methods(wheel: Wheel, filename: str, cls: str, names: tuple[str, ...]) -> str:
    found = find_class(wheel.tree(ROPE + filename), cls)
    body = [node for node in found.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in body} == set(names), (cls, names)
    return "\n".join(ast.unparse(node) for node in body)


def _functions(wheel: Wheel, filename: str, names: tuple[str, ...]) -> str:
    nodes = [n for n in wheel.tree(ROPE + filename).body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {node.name for node in nodes} == set(names)
    return "\n\n".join(ast.unparse(node) for node in nodes)


def sglang_classes(wheel: Wheel) -> dict[str, Any]:
    """SGLang's ``RotaryEmbedding``, ``Llama3RotaryEmbedding`` and ``YaRNScalingRotaryEmbedding`` (CPU, float32)."""
    namespace: dict[str, Any] = {"torch": torch, "math": math, **{n: getattr(typing, n) for n in typing.__all__}}
    # 0.5.17 asks the run's settings whether to compute on the CPU: no RL on-policy target (a plain server).
    namespace["get_exec"] = lambda: types.SimpleNamespace(deterministic=types.SimpleNamespace(rl_on_policy_target=None))
    exec(_functions(wheel, "utils.py", ("apply_rotary_emb",)), namespace)
    exec(_functions(wheel, "yarn.py", ("yarn_find_correction_dim", "yarn_find_correction_range", "yarn_linear_ramp_mask",
                                       "yarn_get_mscale_simple", "yarn_get_mscale")), namespace)
    init = (
        "def __init__(self, head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype):\n"
        "    self.head_size, self.rotary_dim, self.max_position_embeddings = head_size, rotary_dim, max_position_embeddings\n"
        "    self.base, self.is_neox_style, self.dtype, self.position_start = base, is_neox_style, dtype, 0\n"
        "    self._force_native = False\n"
        "    self.cos_sin_cache = self._compute_cos_sin_cache().to(dtype)\n"
        "    self._apply_rotary_emb_wrapped = apply_rotary_emb\n"
    )
    base = _methods(wheel, "base.py", "RotaryEmbedding", ("_compute_inv_freq", "_compute_cos_sin_cache", "forward_native"))
    exec("class RotaryEmbedding:\n" + _indent(init + "\n" + base), namespace)
    llama3 = _methods(wheel, "rope_variant.py", "Llama3RotaryEmbedding", ("__init__", "_compute_inv_freq"))
    exec("class Llama3RotaryEmbedding(RotaryEmbedding):\n" + _indent(llama3), namespace)
    yarn = _methods(wheel, "yarn.py", "YaRNScalingRotaryEmbedding", ("__init__", "_compute_inv_freq", "_compute_cos_sin_cache"))
    exec("class YaRNScalingRotaryEmbedding(RotaryEmbedding):\n" + _indent(yarn), namespace)
    return namespace


def _indent(source: str) -> str:
    return "\n".join("    " + line for line in source.splitlines()) + "\n"


def sglang_module(classes: dict[str, Any], config: dict[str, Any], rotary_dim: int) -> Any:
    """What ``get_rope`` builds for ``config``'s rope_parameters (its argument handling for these types)."""
    scaling = config["rope_parameters"]
    theta, max_position, neox = scaling["rope_theta"], config["max_position_embeddings"], config.get("rope_is_neox_style", True)
    kind = scaling["rope_type"]
    args = (HEAD_DIM, rotary_dim)
    if kind == "default":
        return classes["RotaryEmbedding"](*args, max_position, theta, neox, torch.float32)
    original = scaling.get("original_max_position_embeddings", max_position)
    if kind == "llama3":
        return classes["Llama3RotaryEmbedding"](*args, max_position, theta, neox, torch.float32, scaling["factor"],
                                                scaling["low_freq_factor"], scaling["high_freq_factor"], original)
    extra = {k: v for k, v in scaling.items()
             if k in ("extrapolation_factor", "attn_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
    return classes["YaRNScalingRotaryEmbedding"](*args, original, theta, neox, scaling["factor"], torch.float32,
                                                 truncate=scaling.get("truncate", True), **extra)


CASES = {
    "default": ({"rope_type": "default", "rope_theta": 10000.0}, 1.0, True),
    "partial-gptj": ({"rope_type": "default", "rope_theta": 500.0}, 0.5, False),
    "llama3": ({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, 1.0, True),
    "kimi-yarn": ({"rope_type": "yarn", "rope_theta": 50000.0, "factor": 32.0, "beta_fast": 1.0, "beta_slow": 1.0,
                   "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 64}, 1.0, True),
    "yarn-partial-gptj": ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attn_factor": 0.8,
                           "original_max_position_embeddings": 128}, 0.5, False),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reference_rotary_rotates_as_sglangs_code(version: str, case: str) -> None:
    rope, partial, neox = CASES[case]
    config = {"rope_parameters": dict(rope), "max_position_embeddings": 512, "partial_rotary_factor": partial,
              "rope_is_neox_style": neox}
    ours = sglang_rotary(config, HEAD_DIM)
    assert ours.rotary_dim == int(partial * HEAD_DIM) and ours.neox == neox
    theirs = sglang_module(sglang_classes(get_wheel(version)), config, ours.rotary_dim)
    generator = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 63, 300])
    q, k = torch.randn(5, 3 * HEAD_DIM, generator=generator), torch.randn(5, HEAD_DIM, generator=generator)
    q_sglang, k_sglang = theirs.forward_native(positions, q.clone(), k.clone())
    q_ours = ours.apply(q.view(5, 3, HEAD_DIM).transpose(0, 1), positions).transpose(0, 1).reshape(5, -1)
    k_ours = ours.apply(k.view(5, 1, HEAD_DIM).transpose(0, 1), positions).transpose(0, 1).reshape(5, -1)
    torch.testing.assert_close(q_ours, q_sglang, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_ours, k_sglang, rtol=1e-5, atol=1e-5)


def test_rotary_settings_are_read_where_sglang_reads_them() -> None:
    """rope_parameters first; else rope_scaling with the top-level rope_theta; a type the drafter does not compute is named."""
    legacy = {"rope_theta": 500.0, "rope_scaling": {"type": "linear", "factor": 2.0}, "max_position_embeddings": 64}
    both = {**legacy, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert torch.allclose(sglang_rotary(legacy, 8).inv_freq, 1.0 / (500.0 ** (torch.arange(0, 8, 2) / 8)) / 2.0)
    assert torch.allclose(sglang_rotary(both, 8).inv_freq, 1.0 / (10000.0 ** (torch.arange(0, 8, 2) / 8)))
    assert torch.allclose(sglang_rotary({}, 8).inv_freq, sglang_rotary(both, 8).inv_freq)  # no settings: theta 10000
    with pytest.raises(UnsupportedRope, match="rope_type 'dynamic'"):
        sglang_rotary({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 8)
