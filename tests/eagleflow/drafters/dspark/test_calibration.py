"""DSpark's STS calibration against the pinned SGLang's own recorder, fit and loader, run from the wheel's source.

``sglang/srt/speculative/dspark_components/dspark_sts.py`` (``StsDataRecorder``, ``DSparkStsCalibration``)
and ``sglang/benchmark/dspark_sts_fit.py`` run as they are on CPU: they need only torch and msgspec, so
nothing is stubbed but the empty parent packages. The confidence head's ``apply_sts`` is
``DSparkConfidenceHead`` of ``sglang/srt/models/dspark.py``, executed alone (its module imports half of
SGLang); it is given the temperatures as ``dspark_planner.py`` gives them (a float32 tensor of the file's
list). What is compared: the shard our recording converts to with the one SGLang's recorder writes, the
fit with SGLang's fit on the same rows, and the confidence SGLang computes with the file we wrote.
"""

from __future__ import annotations

import __future__
import ast
import contextlib
import json
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from eagleflow.drafters.dspark.calibration import (
    TEMPERATURE_GRID,
    StsCalibration,
    StsRecord,
    StsRecorder,
    expected_calibration_error,
    fit_temperatures,
    make_record,
    read_calibration,
    read_records,
    write_calibration,
    write_sglang_shard,
)
from eagleflow.errors import UserError
from sglang_wheels import get_wheel, pinned_version

STS = ("sglang.srt.speculative.dspark_components.dspark_sts", "sglang/srt/speculative/dspark_components/dspark_sts.py")
FIT = ("sglang.benchmark.dspark_sts_fit", "sglang/benchmark/dspark_sts_fit.py")
DSPARK = "sglang/srt/models/dspark.py"
GAMMA = 5


@contextlib.contextmanager
def sglang_sts_modules() -> Iterator[types.SimpleNamespace]:
    """``dspark_sts``, ``dspark_sts_fit`` and ``DSparkConfidenceHead`` of the pinned wheel, for the ``with`` block."""
    wheel = get_wheel(pinned_version())
    saved = {name: module for name, module in sys.modules.items() if name == "sglang" or name.startswith("sglang.")}
    try:
        for name in ("sglang", "sglang.srt", "sglang.srt.speculative", STS[0].rpartition(".")[0], "sglang.benchmark"):
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        loaded = {}
        for name, filename in (STS, FIT):  # dspark_sts first: the fit imports it
            module = types.ModuleType(name)
            module.__file__ = f"{wheel.path}/{filename}"
            sys.modules[name] = module
            exec(compile(wheel.text(filename), filename, "exec"), module.__dict__)
            loaded[name] = module
        head = next(n for n in wheel.tree(DSPARK).body if isinstance(n, ast.ClassDef) and n.name == "DSparkConfidenceHead")
        namespace = {"nn": torch.nn, "torch": torch}  # annotations stay text (the module's own __future__ import)
        exec(compile(ast.unparse(head), f"{wheel.path}/{DSPARK}", "exec", flags=__future__.annotations.compiler_flag,
                     dont_inherit=True), namespace)
        yield types.SimpleNamespace(sts=loaded[STS[0]], fit=loaded[FIT[0]], head=namespace["DSparkConfidenceHead"])
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture(scope="module")
def sglang() -> Iterator[types.SimpleNamespace]:
    with sglang_sts_modules() as modules:
        yield modules


def synthetic_records(seed: int, rows: int, scales: list[float]) -> list[StsRecord]:
    """Verify steps whose draft k passes with probability sigmoid(z_k), recorded as logits scale_k · z_k.

    A scale above 1 makes the head over-confident (the fit should find T_k ≈ scale_k), below 1 under-confident.
    """
    rng = np.random.default_rng(seed)
    true = rng.normal(1.0, 1.5, size=(rows, len(scales)))
    passed = rng.random(true.shape) < 1.0 / (1.0 + np.exp(-true))
    counts = np.cumprod(passed, axis=1).sum(axis=1)  # the leading run of accepted drafts
    return [make_record(row * np.array(scales), int(n)) for row, n in zip(true, counts)]


def awkward_records() -> list[StsRecord]:
    """Varied scales (temperatures at both ends of the grid), saturated and zero logits, and every count 0..γ."""
    records = synthetic_records(7, 600, [3.0, 0.4, 1.0, 12.0, 0.05])
    extremes = [make_record([60.0, -60.0, 0.0, 30.0, -0.0], n) for n in range(GAMMA + 1)]
    return records[:300] + extremes + records[300:]


@pytest.mark.sglang_source
def test_the_temperature_grid_is_sglangs(sglang: types.SimpleNamespace) -> None:
    assert list(TEMPERATURE_GRID) == sglang.fit.default_temperature_grid().to(torch.float64).tolist()


@pytest.mark.sglang_source
def test_our_shard_is_the_one_sglangs_recorder_writes(sglang: types.SimpleNamespace, tmp_path: Path) -> None:
    records = awkward_records()
    theirs = sglang.sts.StsDataRecorder(path_stem=str(tmp_path / "theirs"), gamma=GAMMA, flush_every=len(records))
    for record in records:  # one request per verify step, as the worker hands it [bs=1, γ] and [bs=1]
        theirs.record(confidence_raw=torch.tensor([record.confidence_raw]),
                      num_correct_drafts=torch.tensor([record.num_correct_drafts]))
    ours = write_sglang_shard(tmp_path / "ours.0.pt", records)

    expected, written = torch.load(tmp_path / "theirs.0.pt"), torch.load(ours)
    assert written.keys() == expected.keys() == {"logits", "prefix_mask"}
    for key in expected:
        assert written[key].dtype == expected[key].dtype == torch.float32
        assert torch.equal(written[key], expected[key]), key


@pytest.mark.sglang_source
def test_the_fit_equals_sglangs_on_the_same_rows(sglang: types.SimpleNamespace, tmp_path: Path) -> None:
    records = awkward_records()
    with StsRecorder(tmp_path / "confidence.jsonl", GAMMA) as recorder:
        for record in records:
            recorder.record(record.confidence_raw, record.num_correct_drafts)
    read = read_records(tmp_path / "confidence.jsonl", GAMMA)
    assert read == records  # the recording round-trips exactly (float32 values, written as JSON floats)
    data_glob = str(tmp_path / "sts.*.pt")
    write_sglang_shard(tmp_path / "sts.0.pt", read[:250])  # two shards: SGLang's glob and concatenation too
    write_sglang_shard(tmp_path / "sts.1.pt", read[250:])

    sglang.fit.fit(data_glob=data_glob, out=tmp_path / "theirs.json", num_bins=15, gamma=GAMMA)
    ours = write_calibration(tmp_path / "ours.json", fit_temperatures(read, dataset=data_glob))

    expected, written = json.loads((tmp_path / "theirs.json").read_text()), json.loads(ours.read_text())
    assert written.keys() == expected.keys()
    assert written["temperatures"] == expected["temperatures"]
    assert (written["dataset"], written["num_samples"]) == (expected["dataset"], expected["num_samples"]) == (data_glob, 606)
    for name in ("ece_before", "ece_after"):
        assert np.abs(np.subtract(written[name], expected[name])).max() <= 1e-15, name  # torch's and numpy's sigmoid differ in the last bit
    assert {TEMPERATURE_GRID[0], TEMPERATURE_GRID[-1]} <= set(written["temperatures"])  # the grid's ends were reached: the search is not clipped early


@pytest.mark.sglang_source
def test_the_ece_is_sglangs(sglang: types.SimpleNamespace) -> None:
    rng = np.random.default_rng(3)
    probs = np.concatenate([rng.random(500), [0.0, 1.0, 1 / 15, 14 / 15, 0.5]])  # bin edges and the clamp
    targets = (rng.random(probs.size) < 0.4).astype(np.float64)
    for bins in (15, 4):
        theirs = sglang.fit.expected_calibration_error(probs=torch.from_numpy(probs), targets=torch.from_numpy(targets),
                                                       num_bins=bins)
        assert expected_calibration_error(probs, targets, bins) == pytest.approx(theirs, abs=1e-15)


@pytest.mark.sglang_source
def test_sglang_loads_our_file_and_applies_it_as_we_do(sglang: types.SimpleNamespace, tmp_path: Path) -> None:
    fitted = fit_temperatures(synthetic_records(1, 400, [3.0, 2.0, 0.5, 1.0, 6.0]), dataset="held-out prompts")
    path = write_calibration(tmp_path / "dspark_sts.json", fitted)

    loaded = sglang.sts.load_sts_calibration_from_path(str(path))
    assert list(loaded.temperatures) == list(fitted.temperatures)
    assert (loaded.dataset, loaded.num_samples) == ("held-out prompts", 400)
    assert (list(loaded.ece_before), list(loaded.ece_after)) == (list(fitted.ece_before), list(fitted.ece_after))
    assert read_calibration(path, GAMMA) == fitted

    head = sglang.head(hidden_size=4, markov_rank=2)
    head.sts_temperatures = torch.tensor(loaded.temperatures, dtype=torch.float32)  # dspark_planner.py's assignment
    raw = torch.randn(8, GAMMA, dtype=torch.float32) * 4
    theirs = head.apply_sts(raw)
    np.testing.assert_allclose(fitted.confidence(raw.numpy()), theirs.numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(fitted.survival(raw.numpy()), torch.cumprod(theirs, dim=1).numpy(), rtol=1e-5, atol=1e-7)


def test_an_overconfident_head_is_better_calibrated_after_the_fit() -> None:
    scales = [3.0, 3.0, 2.5, 4.0, 3.0]
    fitted = fit_temperatures(synthetic_records(11, 3000, scales))
    assert all(after < before for before, after in zip(fitted.ece_before, fitted.ece_after)), fitted
    assert sum(fitted.ece_after) < 0.5 * sum(fitted.ece_before), fitted
    assert 2.0 < fitted.temperatures[0] < 4.5, fitted.temperatures  # softened towards the true scale (3)
    assert all(t > 1.0 for t in fitted.temperatures), fitted.temperatures


def test_a_torn_record_is_refused_by_line_and_the_recorder_resumes_after_it(tmp_path: Path) -> None:
    path = tmp_path / "confidence.jsonl"
    records = synthetic_records(2, 4, [1.0] * GAMMA)
    with StsRecorder(path, GAMMA) as recorder:
        for record in records[:3]:
            recorder.record(record.confidence_raw, record.num_correct_drafts)
    with open(path, "a", encoding="utf-8") as handle:  # a recorder killed in the middle of its fourth line
        handle.write(records[3].to_line()[:25])

    with pytest.raises(UserError) as refused:
        read_records(path)
    assert str(refused.value).startswith(f"{path} line 4: torn record")
    assert "the 3 records before it are whole" in str(refused.value)

    with StsRecorder(path, GAMMA) as recorder:  # reopening cuts the torn tail off and appends after the whole lines
        recorder.record(records[3].confidence_raw, records[3].num_correct_drafts)
    assert read_records(path, GAMMA) == records


@pytest.mark.parametrize(("line", "message"), [
    ("{not json", "line 2: not a JSON record"),
    ('{"confidence_raw": [1, 2, 3, 4, 5]}', "line 2: field num_correct_drafts is missing"),
    ('{"confidence_raw": [1, 2, 3], "num_correct_drafts": 1}', "line 2: field confidence_raw has 3 logits, but the recording's gamma is 5"),
    ('{"confidence_raw": [1, 2, 3, 4, 5], "num_correct_drafts": 6}', "line 2: num_correct_drafts must be within 0..5"),
    ('{"confidence_raw": [1, NaN, 3, 4, 5], "num_correct_drafts": 1}', "line 2: not a JSON record (NaN is not a number JSON allows)"),
    ('{"confidence_raw": "12345", "num_correct_drafts": 1}', "line 2: field confidence_raw must be a list of numbers"),
])
def test_a_bad_record_line_is_refused_by_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "confidence.jsonl"
    path.write_text(synthetic_records(0, 1, [1.0] * GAMMA)[0].to_line() + line + "\n" + "\n", encoding="utf-8")
    with pytest.raises(UserError) as refused:
        read_records(path)
    assert str(refused.value).startswith(f"{path} {message}"), refused.value


@pytest.mark.parametrize(("content", "gamma", "message"), [
    ({"temperatures": [1.0, 2.0, 1.5, 1.0]}, GAMMA,
     "field temperatures has 4 values, but the drafter's gamma is 5 (SGLang refuses it at start-up)"),
    ({"temperatures": [1.0, 0.0, 1.5, 1.0, 1.0]}, None, "field temperatures[1] is 0.0; every temperature must be > 0"),
    ({"dataset": "x"}, None, "field temperatures is missing"),
    ({"temperatures": [1.0] * 5, "ece_after": [0.1, 0.2]}, None, "field ece_after has 2 values for 5 temperatures"),
    ({"temperatures": [1.0] * 5, "num_samples": "12"}, None, "field num_samples must be an integer"),
    ([1.0, 2.0], None, "expected a JSON object, got list"),
])
def test_a_bad_calibration_file_is_refused_by_file_and_field(tmp_path: Path, content: object, gamma: int | None,
                                                              message: str) -> None:
    path = tmp_path / "dspark_sts.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(UserError) as refused:
        read_calibration(path, gamma)
    assert str(refused.value).startswith(f"{path}: {message}"), refused.value


def test_a_calibration_sglang_would_refuse_is_never_written(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"field temperatures\[2\] is -1.0"):
        write_calibration(tmp_path / "dspark_sts.json", StsCalibration((1.0, 2.0, -1.0)))
    assert not list(tmp_path.iterdir())  # nothing published, no temporary file left


def test_the_module_imports_without_torch() -> None:
    code = "import sys, eagleflow.drafters.dspark.calibration; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.sglang_source
@pytest.mark.parametrize("content", [{"temperatures": [1.0, 0.0]}, {"temperatures": []}, {"dataset": "x"}, [1.0]])
def test_what_sglang_refuses_to_load_we_refuse_too(sglang: types.SimpleNamespace, tmp_path: Path, content: object) -> None:
    path = tmp_path / "dspark_sts.json"
    path.write_text(json.dumps(content), encoding="utf-8")
    with pytest.raises(Exception):  # msgspec.ValidationError or DSparkStsCalibration's ValueError
        sglang.sts.load_sts_calibration_from_path(str(path))
    with pytest.raises(UserError, match=f"^{path}: "):
        read_calibration(path)
