"""The one retry policy of engine requests (``with_retries``) and where the test-only faults come from.

The policy's end-to-end behaviour against real engines (a 500 retried, a killed or hung engine, a
writer behind) is in ``tests/eagleflow/extract``; here its arithmetic: which failures are retried,
how long it waits, when it gives up and what it then says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagleflow.engine import EngineRequestSettings, RowFailed, ServerGone, with_retries
from eagleflow.engine.reference.faults import FAULTS_ENV, EngineFaults, faults_env, faults_from_env
from eagleflow.errors import UserError


class Script:
    """An attempt that raises the scripted failures in turn, then returns "done"."""

    def __init__(self, *failures: Exception) -> None:
        self.failures, self.calls = list(failures), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "done"


def run(script: Script, max_retries: int) -> tuple[str, list[float], list[str]]:
    waits: list[float] = []
    told: list[str] = []
    result = with_retries(script, max_retries, before_retry=lambda exc, delay: told.append(f"{exc.reason} {delay:g}"), sleep=waits.append)
    return result, waits, told


def test_retryable_failures_back_off_exponentially_up_to_30_seconds() -> None:
    script = Script(*[RowFailed("503", retryable=True) for _ in range(7)])
    result, waits, told = run(script, max_retries=7)
    assert (result, script.calls) == ("done", 8)
    assert waits == [1, 2, 4, 8, 16, 30, 30]
    assert told[0] == "503 1"


def test_retries_run_out_naming_the_attempts() -> None:
    script = Script(*[RowFailed("engine answered 500: boom", retryable=True) for _ in range(5)])
    with pytest.raises(RowFailed) as failed:
        run(script, max_retries=2)
    assert script.calls == 3
    assert failed.value.reason == "engine answered 500: boom (after 3 attempts)" and not failed.value.retryable


def test_writer_behind_does_not_use_up_a_retry() -> None:
    behind = [RowFailed("writer behind", retryable=True, counts=False) for _ in range(4)]
    script = Script(*behind, RowFailed("503", retryable=True))
    result, waits, _ = run(script, max_retries=1)
    assert (result, script.calls, len(waits)) == ("done", 6, 5)


@pytest.mark.parametrize("failure", [RowFailed("400: bad input_ids"), ServerGone("engine refuses connections")])
def test_final_failures_end_at_once(failure: Exception) -> None:
    script = Script(failure)
    with pytest.raises(type(failure)) as raised:
        run(script, max_retries=3)
    assert raised.value is failure and script.calls == 1


def test_the_knob_is_declared_once_for_every_requesting_step() -> None:
    from eagleflow.data.regenerate import RegenerateConfig
    from eagleflow.extract import ExtractConfig
    from eagleflow.extract.verify_config import VerifyCaptureConfig

    for step in (ExtractConfig, VerifyCaptureConfig, RegenerateConfig):
        for name in ("request_timeout", "max_retries"):
            field, owner = step.model_fields[name], EngineRequestSettings.model_fields[name]
            assert (field.default, field.description, field.metadata) == (owner.default, owner.description, owner.metadata)


def test_faults_come_from_the_environment_only_when_set(tmp_path: Path) -> None:
    assert faults_from_env({}) == EngineFaults()
    env = faults_env(fail_row=[3], write_delay=0.5)
    assert faults_from_env(env) == EngineFaults(fail_row=[3], write_delay=0.5)
    # A path: the file's faults, read when the engine starts; no file yet means none.
    file = tmp_path / "faults.json"
    assert faults_from_env({FAULTS_ENV: str(file)}) == EngineFaults()
    file.write_text(json.dumps({"capture_fault": "layer-shift"}))
    assert faults_from_env({FAULTS_ENV: str(file)}).capture_fault == "layer-shift"
    with pytest.raises(UserError, match="EAGLEFLOW_TEST_FAULTS: not a valid fault object"):
        faults_from_env({FAULTS_ENV: '{"fail_rows": [3]}'})  # a misspelt fault is refused, not ignored
    with pytest.raises(ValueError):
        faults_env(capture_fault="upside-down")
