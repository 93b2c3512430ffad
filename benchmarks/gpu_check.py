"""``make gpu-check``: the figures only a CUDA machine gives, in ``make bench``'s table.

One script, a few minutes on one GPU, that needs nothing but PyTorch (and safetensors, which the
capture hook needs anyway) and no network. What it measures:

1. the capture hook's cost per pass at Kimi-K2.5's shape on CUDA tensors (two 2,048-token
   requests, 4 slots x 7168, aux ids 3, 31, 59 and the last layer), bf16 and fp8, with the pinned
   host copies the hook makes; fp8 against bf16 in the pass (goal <= 1.1x) and until written;
2. fp8 quantised on the GPU against hs-connectors' quantisation on the GPU, bit for bit (where
   hs-connectors is installed; else against the same code on the CPU, as a count of differences);
3. the dump writer's MB/s with CUDA states (its pinned copies, then its threads), against a raw
   ``safetensors`` save of the same bytes, bf16 and fp8;
4. the reference engine's greedy EAGLE-3 speculative decoding on CUDA against its plain decoding
   (tokens/s, accept length, the same tokens), for the demo's tiny verifier and trained drafter, and
   the same for block decoding with the DFlash drafter of ``demo.py --draft-algorithm dflash``
   (one draft pass per verification) when that run was bundled too;
5. one epoch of the demo's training (``python -m eagleflow train --device cuda``), tokens/s.

Rows 4 and 5 need inputs a bare GPU machine cannot make (a trained drafter needs speculators,
which it may lack), so they come in a bundle made on a CPU machine with the full environment:
``python scripts/demo.py`` (the EAGLE-3 demo run; and ``--draft-algorithm dflash`` for the block row), then
``python benchmarks/gpu_check.py --prepare`` writes ``.cache/gpu-check``
(a few MB; the device tool carries it with ``carry: [".cache/gpu-check"]``). A row whose
inputs or packages are missing says so and is skipped; without CUDA the whole check says why and
exits 0.

Run: ``python benchmarks/gpu_check.py`` (``make gpu-check``); ``--prepare`` on the CPU machine.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_common import REPO, Row, median, ratio_row, run_sections, scratch

BUNDLE = REPO / ".cache" / "gpu-check"
BUNDLE_MANIFEST = "bundle.json"
DEMO_DIR = REPO / ".cache" / "demo"
PROMPTS, MAX_NEW_TOKENS = 12, 48
GOAL_FP8_OVER_BF16 = 1.1
CAPTURE_PAIRS = 5
WRITER_REPEATS = 3
TRAINING_NEEDS = ("speculators", "datasets", "pydantic")


def cuda_unavailable() -> str | None:
    """Why this machine cannot run the check (None: it can)."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch

    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"no CUDA device: torch {torch.__version__} is a CPU build"
        return f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none, torch.cuda.is_available() is False"
    return None


def device_sync(device: str) -> Callable[[], None]:
    """Waits for the device's queued work (nothing to wait for on the CPU)."""
    import torch

    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def missing_modules(names: tuple[str, ...] | list[str]) -> list[str]:
    """The modules of ``names`` this interpreter cannot import."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def skipped(figure: str, reason: str) -> Row:
    """A row that could not be measured here, and why."""
    return Row(figure, "skipped", "-", None, reason)


def guarded(figure: str, measure: Callable[[], list[Row]]) -> list[Row]:
    """``measure()``, or one FAIL row naming the error: the other figures still print."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 (a broken figure must not cost the rest of a short GPU lease)
        return [Row(figure, f"error: {type(exc).__name__}", "runs", False, str(exc)[:300])]


# -- 1. the capture hook ----------------------------------------------------------------------

def capture_rows(work: Path, device: str) -> list[Row]:
    import bench_dump_writer as hook_bench
    import torch

    layers = hook_bench.kimi_layers(device)
    batch_ids = torch.arange(2 * hook_bench.TOKENS, device=device)
    sync = device_sync(device)
    for dtype in ("bf16", "fp8"):  # the first pass of each allocates the pinned host blocks PyTorch then reuses
        hook_bench.capture_pass(work / "hook", layers, batch_ids, dtype, sync)
    runs = hook_bench.dtype_pairs(work / "hook", layers, batch_ids, CAPTURE_PAIRS, sync)
    tokens = 2 * hook_bench.TOKENS
    rows = []
    for dtype in ("bf16", "fp8"):
        seconds = median([r[dtype].hook for r in runs])
        rows.append(Row(f"capture hook per pass, {device}, {dtype} (2 x 2K tokens, 4 x 7168, pinned copies)",
                        f"{seconds * 1e3:.1f} ms = {seconds / tokens * 1e6:.2f} us/token", "report", None,
                        "until the pass's device work is done (torch.cuda.synchronize), the writer's threads not counted"))
    why = "Until the pass's device work is done: the hook's launches, the sums, the quantisation and the copies to pinned memory"
    return rows + hook_bench.fp8_rows(runs, f"{device}, pinned copies", GOAL_FP8_OVER_BF16, why)


# -- 2. fp8 on the GPU: hs-connectors' bytes ----------------------------------------------------

def quantisation_rows(device: str) -> list[Row]:
    import torch

    from sglang_patch.sample_file import quantize_fp8

    generator = torch.Generator().manual_seed(3)
    states = torch.randn(2048, 4, 7168, generator=generator) * torch.logspace(-8, 4, 2048).view(-1, 1, 1)
    states = states.to(torch.bfloat16)
    on_gpu, sync = states.to(device), device_sync(device)
    quantize_fp8(on_gpu)  # warm-up
    sync()
    started = time.perf_counter()
    values, scales = quantize_fp8(on_gpu)
    sync()
    seconds = time.perf_counter() - started
    rows = [Row(f"fp8 quantisation, {device} (2,048 x 4 x 7168 bf16)", f"{states.numel() * 2 / seconds / 1e9:.1f} GB/s of bf16",
                "report", None, f"{seconds * 1e3:.2f} ms, a chunk of tokens per few kernels")]
    if importlib.util.find_spec("hs_connectors") is not None:
        from hs_connectors.fp8_utils import quantize_tensor_to_fp8

        theirs, their_scales = quantize_tensor_to_fp8(on_gpu)
        same = torch.equal(values.view(torch.uint8), theirs.view(torch.uint8)) and torch.equal(scales, their_scales)
        rows.append(Row(f"fp8 on {device} equals hs-connectors' quantize_tensor_to_fp8 there", "bit for bit" if same else "DIFFERS",
                        "bit for bit", same))
    else:
        cpu_values, cpu_scales = quantize_fp8(states)
        scales_off = int((scales.cpu() != cpu_scales).sum())
        bytes_off = int((values.cpu().view(torch.uint8) != cpu_values.view(torch.uint8)).sum())
        rows.append(Row(f"fp8 on {device} vs the same code on the CPU", f"{scales_off} of {scales.numel()} scales, {bytes_off:,} bytes differ",
                        "report", None, "hs-connectors is not installed here, so its own GPU bytes cannot be compared; CUDA divides "
                        "by a Python scalar as a product with its reciprocal (hs-connectors' amax / 448 there too), the CPU divides"))
    return rows


# -- 3. the dump writer -------------------------------------------------------------------------

def writer_rows(work: Path, device: str) -> list[Row]:
    import bench_dump_writer as writer_bench
    import torch

    states = torch.randn(writer_bench.TOKENS, writer_bench.SLOTS, writer_bench.HIDDEN,
                         generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ids = torch.arange(writer_bench.TOKENS)
    on_gpu = states.to(device)
    size = writer_bench.REQUESTS * (states.numel() * 2 + ids.numel() * 8) / 1e6  # bf16 bytes in, for both dtypes
    rows = []
    for dtype in ("bf16", "fp8"):
        writer_bench.writer_run(work / "warm", on_gpu, ids, dtype)
        runs = []
        for _ in range(WRITER_REPEATS):
            ours = writer_bench.writer_run(work / "dumps", on_gpu, ids, dtype)
            raw = writer_bench.raw_run(work / "raw", states, ids)
            runs.append((size / ours, size / raw))
        shown = median([o / r for o, r in runs])
        pick = min(runs, key=lambda run: abs(run[0] / run[1] - shown))
        rows.append(ratio_row(f"dump writer, {device} states, {dtype}: MB/s of bf16 states in vs raw save", pick[0], pick[1],
                              writer_bench.GOAL_RATIO,
                              note=f"{writer_bench.REQUESTS} x 2K-token Kimi requests, fsynced; ratios {', '.join(f'{o / r:.2f}' for o, r in runs)}"))
    return rows


# -- 4. speculative decoding ----------------------------------------------------------------------

@dataclass(frozen=True)
class SpecFigures:
    """Speculative against plain decoding over the bundle's prompts."""

    plain_tokens_per_s: float
    speculative_tokens_per_s: float
    accept_length: float
    same_tokens: int
    prompts: int

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.plain_tokens_per_s


def greedy_tokens(model: Any, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference engine's plain decoding: the prompt, then one target forward per token on its KV cache."""
    import torch

    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([input_ids], device=device), use_cache=True)
    tokens: list[int] = []
    for step in range(max_new_tokens):
        tokens.append(int(torch.argmax(out.logits[0, -1])))
        if step + 1 < max_new_tokens:
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens


def load_decoder(model: Any, bundle: Path, block: bool) -> Any:
    """The bundled EAGLE-3 drafter's chain decoder, or (``block``) the bundled DFlash drafter's block decoder."""
    manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text())
    if block:
        from eagleflow.drafters.dflash.reference import load_dflash_decoder

        entry = manifest["block_drafter"]
        return load_dflash_decoder(model, bundle / entry["path"], int(entry["block_size"]))
    from eagleflow.drafters.eagle3.reference import load_speculative_decoder

    return load_speculative_decoder(model, bundle / "drafter", int(manifest["num_steps"]), manifest.get("window"))


def speculative_figures(bundle: Path, device: str, block: bool = False) -> SpecFigures:
    """Plain and speculative greedy decoding of every bundled prompt on ``device`` (float32, like the tests)."""
    import torch
    from transformers import AutoModelForCausalLM

    manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text())
    model = AutoModelForCausalLM.from_pretrained(str(bundle / "verifier"), dtype=torch.float32).to(device).eval()
    decoder = load_decoder(model, bundle, block)
    prompts, new_tokens = manifest["prompts"], int(manifest["max_new_tokens"])
    sync = device_sync(device)
    plain_s = spec_s = 0.0
    same = completion = verify = 0
    with torch.inference_mode():
        greedy_tokens(model, prompts[0], new_tokens)  # warm-up of both paths (kernels, allocator)
        decoder.generate(prompts[0], new_tokens, set(), True)
        for prompt in prompts:
            sync()
            started = time.perf_counter()
            expected = greedy_tokens(model, prompt, new_tokens)
            sync()
            plain_s += time.perf_counter() - started
            started = time.perf_counter()
            got, _, stats = decoder.generate(prompt, new_tokens, set(), True)  # ignore_eos: both make new_tokens
            sync()
            spec_s += time.perf_counter() - started
            same += int(got == expected)
            completion += len(got)
            verify += stats.verify_ct
    tokens = len(prompts) * new_tokens
    return SpecFigures(tokens / plain_s, tokens / spec_s, completion / max(verify, 1), same, len(prompts))


def speculative_rows(bundle: Path, device: str, block: bool = False) -> list[Row]:
    kind = "block decoding (DFlash)" if block else "speculative decoding"
    figure = f"{kind}, reference engine, {device}: tokens/s vs plain decoding"
    if not (bundle / BUNDLE_MANIFEST).is_file():
        return [skipped(figure, f"no trained drafter in {bundle}: on a CPU machine with the full environment run `python scripts/demo.py`, then "
                                "`python benchmarks/gpu_check.py --prepare`, and carry .cache/gpu-check")]
    if block and not json.loads((bundle / BUNDLE_MANIFEST).read_text()).get("block_drafter"):
        return [skipped(figure, "no DFlash drafter in the bundle: run `python scripts/demo.py --draft-algorithm dflash` before --prepare")]
    missing = missing_modules(["transformers"])
    if missing:
        return [skipped(figure, f"needs {', '.join(missing)}, not installed here")]
    spec = speculative_figures(bundle, device, block)
    return [
        Row(figure, f"{spec.speculative_tokens_per_s:,.0f} vs {spec.plain_tokens_per_s:,.0f} tokens/s = {spec.speedup:.2f}x", "report",
            None, f"accept length {spec.accept_length:.2f} (completion tokens / verifications); {spec.prompts} held-out prompts, "
            f"{MAX_NEW_TOKENS} new tokens each, float32, one at a time"),
        Row(f"{kind}, {device}: the same tokens as plain greedy decoding", f"{spec.same_tokens} of {spec.prompts} prompts",
            "all", spec.same_tokens == spec.prompts),
    ]


# -- 5. training ------------------------------------------------------------------------------------

def training_rows(bundle: Path, work: Path, device: str) -> list[Row]:
    figure = f"demo training, {device}, one epoch: tokens/s"
    missing = missing_modules(TRAINING_NEEDS)
    if missing:
        return [skipped(figure, f"needs {', '.join(missing)}, not installed here (speculators trains; the GPU machine's image has none of these)")]
    if not (bundle / "dataset").is_dir():
        return [skipped(figure, f"no demo dataset in {bundle}: run `python benchmarks/gpu_check.py --prepare` on the CPU machine")]
    from eagleflow.demo import DEMO_PARAMS
    from eagleflow.metrics.records import read_records
    from eagleflow.train.config import TrainConfig

    manifest = json.loads((bundle / BUNDLE_MANIFEST).read_text())
    knobs = {k: v for k, v in DEMO_PARAMS.items() if k in TrainConfig.model_fields}
    knobs.update(epochs=1, device=device.split(":")[0])
    out = work / "train"
    argv = [sys.executable, "-m", "eagleflow", "train", "--dataset", str(bundle / "dataset"), "--verifier", str(bundle / "verifier"),
            "--out", str(out), "--aux-layer-ids", ",".join(map(str, manifest["aux_layer_ids"])), "--restart"]
    for name, value in knobs.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=480, check=False,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    if done.returncode != 0:
        return [Row(figure, f"exit {done.returncode}", "runs", False, (done.stdout + done.stderr)[-300:])]
    rates = [r["tokens_per_s"] for r in read_records(out / "metrics.jsonl") if r.get("kind") == "train" and r.get("tokens_per_s")]
    if not rates:
        return [Row(figure, "no tokens_per_s in metrics.jsonl", "runs", False)]
    return [Row(figure, f"{median(rates):,.0f} tokens/s", "report", None, f"median of {len(rates)} logged steps (speculators' own figure)")]


# -- the bundle (made on the CPU machine) -------------------------------------------------------------

def prepare(run: Path, verifier: Path, bundle: Path, block_run: Path | None = None) -> Path:
    """Copy a finished demo run's verifier, exported drafter, dataset and held-out prompts into ``bundle``, and
    the DFlash drafter of ``block_run`` (``demo.py --draft-algorithm dflash``) when it finished."""
    from eagleflow.verifier.config import resolve_aux_layer_ids
    from eagleflow.evaluate.prompts import held_out_prompts
    from eagleflow.export.manifest import ServedDrafter
    from eagleflow.layout import RunLayout

    layout = RunLayout(run)
    served = ServedDrafter.from_export(layout.drafter)
    prompts = held_out_prompts(layout.dataset, 0.9, PROMPTS)
    tmp = bundle.with_name(f".{bundle.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(verifier, tmp / "verifier")
    shutil.copytree(served.path, tmp / "drafter")
    shutil.copytree(layout.dataset, tmp / "dataset")
    block_drafter = None
    if block_run is not None and (RunLayout(block_run).drafter / "export.json").is_file():
        block = ServedDrafter.from_export(RunLayout(block_run).drafter)
        shutil.copytree(block.path, tmp / "dflash-drafter")
        block_drafter = {"path": "dflash-drafter", "block_size": block.block_size}
    manifest = {
        "block_drafter": block_drafter,
        "run": str(layout.root), "num_steps": served.num_steps, "window": served.window, "max_new_tokens": MAX_NEW_TOKENS,
        "aux_layer_ids": resolve_aux_layer_ids(verifier, None), "prompts": [p.input_ids for p in prompts],
    }
    (tmp / BUNDLE_MANIFEST).write_text(json.dumps(manifest))
    shutil.rmtree(bundle, ignore_errors=True)
    os.replace(tmp, bundle)
    return bundle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", action="store_true", help="make the bundle from a finished `python scripts/demo.py` run (on the CPU machine)")
    parser.add_argument("--run", type=Path, default=DEMO_DIR / "runs" / "demo", help="the demo run folder --prepare reads")
    parser.add_argument("--block-run", type=Path, default=DEMO_DIR / "runs" / "demo-dflash",
                        help="the DFlash demo run folder --prepare reads too, when it finished")
    parser.add_argument("--verifier", type=Path, default=DEMO_DIR / "tiny-model", help="the demo's verifier --prepare copies")
    parser.add_argument("--bundle", type=Path, default=BUNDLE, help="where the bundle is (written by --prepare)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu runs the same code as a dry run (its figures mean nothing)")
    args = parser.parse_args(argv)
    if args.prepare:
        print(f"gpu_check: bundle written to {prepare(args.run, args.verifier, args.bundle, args.block_run)}; carry it as .cache/gpu-check", flush=True)
        return 0
    device = args.device
    reason = cuda_unavailable() if device.startswith("cuda") else None
    if reason:
        print(f"gpu_check: skipped: {reason}. Its figures need a CUDA GPU; run `make gpu-check` on one.", flush=True)
        return 0
    import torch

    where = torch.cuda.get_device_name() if device.startswith("cuda") else "the CPU (a dry run)"
    print(f"gpu_check on {where} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    with scratch("gpu-check") as work:
        sections = (
            ("capture hook", lambda: capture_rows(work, device)),
            ("fp8 quantisation", lambda: quantisation_rows(device)),
            ("dump writer", lambda: writer_rows(work, device)),
            ("speculative decoding", lambda: speculative_rows(args.bundle, device)),
            ("block decoding", lambda: speculative_rows(args.bundle, device, block=True)),
            ("training", lambda: training_rows(args.bundle, work, device)),
        )
        # A section that fails (a missing bundle, a CUDA error) is a failed row; the others still run.
        return run_sections("eagleflow GPU check", [(name, functools.partial(guarded, name, measure)) for name, measure in sections])

if __name__ == "__main__":
    sys.exit(main())
