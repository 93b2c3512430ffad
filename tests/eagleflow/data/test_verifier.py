"""Facts read from a verifier's config.json, for plain and multimodal (nested) configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.verifier.config import config_int, resolve_aux_layer_ids, text_config
from eagleflow.errors import UserError


def model(tmp_path: Path, name: str, config: dict) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("nest", [None, "text_config", "language_config"])
def test_text_config_is_found_plain_or_nested(tmp_path: Path, nest: str | None) -> None:
    text = {"num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840}
    config = text if nest is None else {"architectures": ["KimiK25ForConditionalGeneration"], nest: text, "hidden_size": 1}
    folder = model(tmp_path, str(nest), config)
    assert text_config(folder)["hidden_size"] == 7168
    assert config_int(folder, "num_hidden_layers") == 61


def test_missing_or_bad_fields_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no config.json"):
        config_int(tmp_path, "hidden_size")
    folder = model(tmp_path, "m", {"hidden_size": "wide"})
    with pytest.raises(UserError, match=r"config\.json has no integer 'hidden_size'"):
        config_int(folder, "hidden_size")


def test_aux_ids_default_to_speculators_and_are_checked_against_the_depth(tmp_path: Path) -> None:
    folder = model(tmp_path, "m", {"text_config": {"num_hidden_layers": 8}})
    assert resolve_aux_layer_ids(folder, None) == [2, 4, 5]
    assert resolve_aux_layer_ids(folder, [8, 0]) == [8, 0]
    with pytest.raises(UserError, match=r"^Param aux_layer_ids: aux layer ids \[9\] are outside 0\.\.8"):
        resolve_aux_layer_ids(folder, [2, 9], name="Param aux_layer_ids")
    with pytest.raises(UserError, match=r"^--aux-layer-ids: .*repeat \[2\]"):
        resolve_aux_layer_ids(folder, [2, 2])
