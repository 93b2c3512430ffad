"""compare: every drafter of a run side by side, from real evaluation reports, weights and training results."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from drafter_runs import EAGLE3_CONFIGS, numel, write_drafter, write_two_drafters
from eagleflow.errors import UserError
from eagleflow.report import compare
from eagleflow.results import find_result


def compare_step(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "eagleflow", "compare", *argv], capture_output=True, text=True, timeout=120)


def compare_in_process(*argv: str) -> dict[str, Any]:
    """``main`` with the flags ``argv``, as ``python -m eagleflow compare`` parses them; returns compare.json."""
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(argv)
    assert compare.main(args) == 0
    return json.loads((Path(args.run) / "eval" / "compare.json").read_text())


def by_label(comparison: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["label"]: d for d in comparison["drafters"]}


def test_two_drafters_side_by_side_with_a_winner_per_batch_size(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "multi"
    layouts = write_two_drafters(run)
    proc = compare_step("--run", str(run), "--drafters", "eagle3,dflash")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    comparison = json.loads((run / "eval" / "compare.json").read_text())
    drafters = by_label(comparison)
    assert list(drafters) == ["eagle3", "dflash"] and comparison["missing"] == [] and comparison["mismatch"] == {}
    eagle3, dflash = drafters["eagle3"], drafters["dflash"]
    assert (eagle3["algorithm"], dflash["algorithm"]) == ("EAGLE3", "DFLASH")
    # The table: every config with the drafter (the baselines left out), its figures per prompt set as measured.
    assert [c["config"] for c in eagle3["configs"]] == ["1,3,1,4", "1,3,4,8", "2,3,1,4"]
    assert [c["config"] for c in dflash["configs"]] == ["1,1,1,8", "2,1,1,8"]
    heldout = eagle3["configs"][1]["sets"]["heldout"]
    assert heldout["accept_length"] == {"mean": 2.5, "p50": 2.5, "p90": 2.5}
    assert heldout["accept_rate"] == pytest.approx((60 - 24) / (3 * 24))  # accepted / proposed drafts
    assert heldout["speedup"] == {"median": pytest.approx(1.6), "min": pytest.approx(1.4), "max": pytest.approx(1.8), "disturbed": False}
    assert heldout["tokens_per_s"]["median"] == pytest.approx(2 * 60 * 1.6)  # 2 prompts of 60 tokens, the baseline at 1 s
    assert eagle3["configs"][1]["sets"]["humaneval"]["speedup"]["median"] == pytest.approx(1.3)
    # Size from the safetensors headers (elements of every tensor), bytes the files'; training time when recorded.
    weights = layouts["eagle3"].drafter / "sglang" / "model.safetensors"
    assert eagle3["parameters"] == numel() == 136 and eagle3["bytes"] == weights.stat().st_size
    assert dflash["parameters"] == numel(((4, 4), (32, 2), (3,))) == 83
    assert eagle3["train_seconds"] == 3725.0 and dflash["train_seconds"] is None
    # Per batch size the fastest drafter differs: EAGLE-3's 1,3,4,8 at 1 (mean of 1.6 and 1.3 over DFlash's 1.3), DFlash at 2.
    fastest = comparison["fastest"]
    assert list(fastest) == ["1", "2"]
    assert (fastest["1"]["drafter"], fastest["1"]["config"]) == ("eagle3", "1,3,4,8")
    assert fastest["1"]["mean_speedup"] == pytest.approx(1.45)
    assert fastest["1"]["spread"] == [pytest.approx(1.2), pytest.approx(1.8)] and fastest["1"]["accept_length"] == 2.25
    assert (fastest["2"]["drafter"], fastest["2"]["config"]) == ("dflash", "2,1,1,8")
    assert fastest["2"]["mean_speedup"] == pytest.approx(1.6)
    # The winner: the fastest at the smallest batch size, with the exact flags its evaluation served it with.
    winner = comparison["winner"]
    report = json.loads((layouts["eagle3"].evaluation / "report.json").read_text())
    flags = next(row["sglang_flags"] for row in report["sweep"] if row["config"] == "1,3,4,8")
    assert (winner["drafter"], winner["config"], winner["batch_size"]) == ("eagle3", "1,3,4,8", 1)
    assert winner["sglang_flags"] == flags and str(layouts["eagle3"].drafter / "sglang") in flags
    assert "winner" in comparison["definitions"] and "smallest batch size" in comparison["definitions"]["winner"]
    # The chart beside compare.json, and the result line naming all three.
    for suffix, magic in (("png", b"\x89PNG"), ("svg", b"<?xml")):
        assert (run / "eval" / f"compare.{suffix}").read_bytes().startswith(magic)
    result = find_result(proc.stdout.splitlines())
    assert result == {"compare": str(run / "eval" / "compare.json"), "winner": winner,
                      "png": str(run / "eval" / "compare.png"), "svg": str(run / "eval" / "compare.svg")}
    assert "compare: winner: eagle3 1,3,4,8 at batch size 1, 1.45x" in proc.stdout


def test_a_drafter_without_a_readable_report_is_listed_and_the_others_compared(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "runs" / "multi"
    layouts = write_two_drafters(run)
    (layouts["dflash"].evaluation / "report.json").unlink()  # its evaluation failed
    torn = write_drafter(run, "torn", "EAGLE3", EAGLE3_CONFIGS)
    (torn.evaluation / "report.json").write_text('{"sweep": [')
    comparison = compare_in_process("--run", str(run), "--drafters", "eagle3,dflash,torn")
    assert list(by_label(comparison)) == ["eagle3"]
    missing = {m["drafter"]: m["reason"] for m in comparison["missing"]}
    assert list(missing) == ["dflash", "torn"]
    assert missing["dflash"] == "no drafters/dflash/eval/report.json: its evaluation failed or was skipped"
    assert missing["torn"].startswith("drafters/torn/eval/report.json is unreadable")
    assert comparison["winner"]["drafter"] == "eagle3" and comparison["fastest"]["2"]["config"] == "2,3,1,4"
    out = capsys.readouterr().out
    assert "compare: dflash: not compared: no drafters/dflash/eval/report.json" in out


def test_evaluations_not_measured_alike_are_reported(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "multi"
    write_drafter(run, "eagle3", "EAGLE3", EAGLE3_CONFIGS)
    write_drafter(run, "dflash", "DFLASH", {"1,1,1,8": (3.0, [1.2, 1.3]), "4,1,1,8": (3.0, [1.5, 1.6])}, sets=("heldout",),
                  chat_template_kwargs={"enable_thinking": False})
    comparison = compare_in_process("--run", str(run), "--drafters", "eagle3,dflash")
    assert comparison["mismatch"] == {
        "prompt_sets": {"eagle3": ["heldout", "humaneval"], "dflash": ["heldout"]},
        "batch_sizes": {"eagle3": [1, 2], "dflash": [1, 4]},
        "chat_template_kwargs": {"eagle3": {}, "dflash": {"enable_thinking": False}},  # prompts rendered in another mode
    }
    assert list(comparison["fastest"]) == ["1", "2", "4"]  # still compared, each batch size measured


def test_the_winner_is_at_the_smallest_batch_size_with_a_trustworthy_speedup(tmp_path: Path) -> None:
    """At batch size 1 every speedup is above its accept length (disturbed, no figure): the winner is batch size 2's."""
    run = tmp_path / "runs" / "multi"
    write_drafter(run, "eagle3", "EAGLE3", {"1,3,1,4": (1.5, [1.8, 1.9, 2.0]), "2,3,1,4": (2.0, [1.1, 1.2, 1.3])})
    write_drafter(run, "dflash", "DFLASH", {"1,1,1,8": (1.5, [1.7, 1.8, 1.9]), "2,1,1,8": (3.0, [1.3, 1.4, 1.5])})
    comparison = compare_in_process("--run", str(run), "--drafters", "eagle3,dflash")
    assert by_label(comparison)["eagle3"]["configs"][0]["sets"]["heldout"]["speedup"]["disturbed"] is True
    assert list(comparison["fastest"]) == ["2"]
    assert (comparison["winner"]["drafter"], comparison["winner"]["batch_size"]) == ("dflash", 2)


def test_the_runs_one_drafter_without_names_and_no_drafter_is_a_user_error(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "single"
    write_drafter(run, None, "EAGLE3", EAGLE3_CONFIGS, train_seconds=12.5)
    for flags in ([], ["--drafters="]):  # no flag, or the empty name: the drafter in the run folder itself
        comparison = compare_in_process("--run", str(run), *flags)
        (only,) = comparison["drafters"]
        assert (only["label"], only["name"], only["train_seconds"]) == ("single", None, 12.5)
        assert comparison["winner"]["config"] == "1,3,4,8"
    empty = tmp_path / "runs" / "empty"
    empty.mkdir()
    proc = compare_step("--run", str(empty), "--drafters", "eagle3,dflash")
    assert proc.returncode == 2 and f"no drafter of the run {empty} has an evaluation report" in proc.stderr
    assert "eagle3: no drafters/eagle3/eval/report.json" in proc.stderr and not (empty / "eval" / "compare.json").exists()
    with pytest.raises(UserError, match="no such run folder"):
        compare.compare_drafters(compare.CompareConfig(run=tmp_path / "runs" / "absent"))
