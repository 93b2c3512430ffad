"""The context length as SGLang derives it from a config, and the room a prompt leaves in it."""

from __future__ import annotations

import pytest

from eagleflow.engine.context import (
    context_length_of_model_list,
    derived_context_length,
    max_new_tokens_left,
    model_list,
)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"max_position_embeddings": 4096}, 4096),
        # The first of SGLang's keys that is set wins, whatever max_position_embeddings says.
        ({"seq_length": 8192, "max_position_embeddings": 2048}, 8192),
        ({"max_sequence_length": 100, "seq_length": 200, "model_max_length": 300}, 100),
        # Rope scaling multiplies, unless it is YaRN-style (names the original length) or llama3.
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 4.0}}, 16384),
        ({"max_position_embeddings": 262144,
          "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096}}, 262144),
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}, 4096),
        ({"hidden_size": 64}, 2048),  # none of the keys: SGLang's default
    ],
)
def test_derived_context_length_follows_sglangs_rule(config: dict, expected: int) -> None:
    assert derived_context_length(config) == expected


def test_a_transformers_config_object_reads_the_same(tiny_model) -> None:
    from transformers import AutoConfig

    from eagleflow.verifier.config import text_config

    assert derived_context_length(AutoConfig.from_pretrained(str(tiny_model)).get_text_config()) == derived_context_length(
        text_config(tiny_model)
    ) == 4096


def test_the_room_a_prompt_leaves_keeps_one_token_spare() -> None:
    # SGLang 0.5.10 refuses prompt + max_new_tokens == context: the budget stops one short.
    assert max_new_tokens_left(96, 94) == 1
    assert max_new_tokens_left(96, 95) == 0
    assert max_new_tokens_left(96, 120) < 0


def test_the_model_list_round_trips_and_odd_answers_say_nothing() -> None:
    assert context_length_of_model_list(model_list("/models/m", 4096, created=1)) == 4096
    for answer in (None, [], {}, {"data": []}, {"data": [{"id": "m"}]}, {"data": [{"max_model_len": None}]},
                   {"data": [{"max_model_len": True}]}, {"data": ["m"]}, {"object": "error", "message": "x"}):
        assert context_length_of_model_list(answer) is None, answer
