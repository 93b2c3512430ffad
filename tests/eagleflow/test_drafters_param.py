"""Several drafters from one capture: the drafters Param, each drafter's settings and folders, the union capture."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from eagleflow.drafters import drafter_plan, slots_of, union_of_layers
from eagleflow.errors import UserError
from eagleflow.run.pipeline import PipelineConfig


def base(tmp_path: Path, model: Path, **more: Any) -> dict[str, Any]:
    return {"model_path": str(model), "dataset_input": str(tmp_path / "in.jsonl"), "output_root": str(tmp_path / "runs"),
            "run_name": "r", **more}


def test_entries_are_family_names_or_objects_named_by_their_family_unless_named() -> None:
    plan = drafter_plan(["eagle3", {"name": "dflash-b8", "draft_algorithm": "dflash", "block_size": 8}, {"draft_algorithm": "dflash"}], "eagle3")
    assert plan == [
        {"name": "eagle3", "folder": "eagle3", "settings": {"draft_algorithm": "eagle3"}},
        {"name": "dflash-b8", "folder": "dflash-b8", "settings": {"draft_algorithm": "dflash", "block_size": 8}},
        {"name": "dflash", "folder": "dflash", "settings": {"draft_algorithm": "dflash"}},
    ]
    # No entry: the run's one drafter, in the run folder itself (every run made before the Param).
    assert drafter_plan([], "dflash") == [{"name": "dflash", "folder": None, "settings": {}}]


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        (["dflash", "dflash"], "two drafters are named 'dflash'"),
        ([{"draft_algorithm": "dflash", "eval_rows": 4}], "entry 0 sets eval_rows, which every drafter of a run shares"),
        ([{"name": "../up"}], "entry 0: drafter name"),
        ([3], "entry 0 is 3"),
    ],
)
def test_a_bad_entry_is_refused_naming_it(entries: list[Any], words: str) -> None:
    with pytest.raises(ValueError, match="Param drafters") as info:
        drafter_plan(entries, "eagle3")
    assert words in str(info.value)


def test_the_capture_is_the_union_and_each_drafter_reads_its_own_slots() -> None:
    assert union_of_layers([[2, 4, 6], [1, 3, 4, 6, 7]]) == [1, 2, 3, 4, 6, 7]
    # A sample of the union holds its 6 layers, then the final state: slot 6.
    assert slots_of([2, 4, 6], [1, 2, 3, 4, 6, 7]) == [1, 3, 4, 6]
    with pytest.raises(ValueError, match=r"\[5\] were not captured"):
        slots_of([5], [1, 2])


def test_each_drafter_sees_its_own_settings_folders_and_layers(tmp_path: Path, random_tiny_model: Path) -> None:
    drafters = ["eagle3", {"name": "dflash-b4", "draft_algorithm": "dflash", "block_size": 4, "mask_token_id": 0,
                           "aux_layer_ids": [1, 3, 4, 6, 7], "lr": 1e-3}]
    cfg = PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=drafters, draft_vocab_size=256, aux_layer_ids=[2, 4, 6]))
    eagle, dflash = (cfg.for_drafter(d) for d in cfg.drafter_plan())
    assert cfg.captured_aux_layer_ids() == [1, 2, 3, 4, 6, 7]
    # The engines and extraction capture the union once.
    assert cfg.extract_config(_server(), {"name": "rows_0-2", "start": 0, "end": 2}).aux_layer_ids == [1, 2, 3, 4, 6, 7]
    run = cfg.layout.root
    eagle_train, dflash_train = eagle.train_config(), dflash.train_config()
    assert (eagle_train.out, dflash_train.out) == (run / "drafters/eagle3/train", run / "drafters/dflash-b4/train")
    assert (eagle_train.aux_layer_ids, eagle_train.sample_slots) == ([2, 4, 6], [1, 3, 4, 6])
    assert (dflash_train.aux_layer_ids, dflash_train.sample_slots) == ([1, 3, 4, 6, 7], [0, 2, 3, 4, 5, 6])
    # Each its own settings over the run's; a block drafter keeps the full vocabulary the EAGLE-3's reduced one is not.
    assert (eagle_train.draft_algorithm, eagle_train.lr, eagle_train.draft_vocab_size) == ("eagle3", 3e-5, 256)
    assert (dflash_train.draft_algorithm, dflash_train.block_size, dflash_train.lr) == ("dflash", 4, 1e-3)
    assert dflash_train.draft_vocab_size != 256
    assert eagle.export_config().out == run / "drafters/eagle3/drafter"
    assert dflash.evaluate_config().out == run / "drafters/dflash-b4/eval"
    assert dflash.evaluate_config().drafter == run / "drafters/dflash-b4/drafter"
    assert dflash.plot_config().out == run / "drafters/dflash-b4/train-progress"
    # The run's one drafter (no Param) keeps the run folder's own train/, as every earlier run.
    single = PipelineConfig.from_params(base(tmp_path, random_tiny_model))
    assert single.for_drafter(single.drafter_plan()[0]).train_config().out == run / "train"
    assert single.train_config().sample_slots is None


def test_a_drafters_bad_setting_is_refused_by_its_familys_rules_naming_the_drafter(tmp_path: Path, random_tiny_model: Path) -> None:
    with pytest.raises(UserError, match=r"Param drafters \(d\).*draft_vocab_size") :
        PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=[{"name": "d", "draft_algorithm": "dflash", "draft_vocab_size": 256}]))
    with pytest.raises(UserError, match=r"Param drafters \(e\) lr"):
        PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=[{"name": "e", "lr": -1}]))
    with pytest.raises(UserError, match=r"Param drafters: online .* the same number of epochs.*eagle3 5, d 2"):
        PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=["eagle3", {"name": "d", "epochs": 2}], hidden_states_source="engine"))
    cfg = PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=[{"name": "far", "aux_layer_ids": [2, 30]}]))
    with pytest.raises(UserError, match=r"Param drafters \(far\) aux_layer_ids"):
        cfg.check_model()


def test_a_drafter_reads_exactly_its_slots_of_a_stored_sample(tmp_path: Path) -> None:
    """speculators' loader gets the drafter's layers, then the final state, from a file of the union."""
    from safetensors.torch import save_file

    from eagleflow.train.slots_backend import SlotsTransfer

    states = torch.randn(5, 4, 8)  # 3 captured layers + the final state
    folder = tmp_path / "hidden_states"
    folder.mkdir()
    save_file({"hidden_states": states.to(torch.bfloat16), "token_ids": torch.arange(5)}, str(folder / "hs_0.safetensors"))
    sample = SlotsTransfer(folder, [0, 2, 3]).get_cached(0)
    assert sample is not None
    assert torch.equal(sample["hidden_states"], states.to(torch.bfloat16)[:, [0, 2, 3]])
    assert torch.equal(sample["token_ids"], torch.arange(5))


def _server() -> Any:
    from eagleflow.engine.process import ServerInfo

    return ServerInfo(url="http://127.0.0.1:1", pid=None, host="h", log_path="l", dump_dir="/tmp/d", name="engine-0")


def test_online_every_drafters_trainer_knows_the_others_and_the_first_leads(tmp_path: Path, random_tiny_model: Path) -> None:
    """Several drafters online: each trainer's config lists every drafter's folder, in the run's order; the feed
    settings make the first the lead handing samples to the others, and the others its followers."""
    from eagleflow.engine.process import ServerInfo
    from eagleflow.train.online.settings import shared_feed

    cfg = PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=["eagle3", {"name": "b", "lr": 1e-3}],
                                          hidden_states_source="engine"))
    engine = ServerInfo(url="http://127.0.0.1:1", pid=None, host="h", log_path="l", dump_dir=str(tmp_path / "d"), name="engine-0")
    lead, follower = (cfg.for_drafter(d).train_config([engine]) for d in cfg.drafter_plan())
    run = cfg.layout.root
    assert lead.online_trainers == follower.online_trainers == [run / "drafters/eagle3/train", run / "drafters/b/train"]
    assert shared_feed(lead) == {"followers": {"b": run / "drafters/b/train/online"}}
    assert shared_feed(follower) == {"lead": run / "drafters/eagle3/train/online"}
    # One drafter: a lone feed, as before.
    single = PipelineConfig.from_params(base(tmp_path, random_tiny_model, hidden_states_source="engine"))
    assert shared_feed(single.train_config([engine])) == {}


@pytest.mark.parametrize(("algorithm", "words"), [("nope", "unknown draft algorithm 'nope'"), ("dflash2", "draft algorithm 'dflash2' is not offered")])
def test_an_entry_naming_an_unknown_or_refused_family_is_refused_by_name(
    tmp_path: Path, random_tiny_model: Path, algorithm: str, words: str
) -> None:
    for entry, label in (({"name": "x", "draft_algorithm": algorithm}, "x"), (algorithm, algorithm)):
        with pytest.raises(UserError, match=rf"^Param drafters \({label}\) draft_algorithm: {words}"):
            PipelineConfig.from_params(base(tmp_path, random_tiny_model, drafters=["eagle3", entry]))


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"mask_token_id": 1024}, "mask token id 1024 is not below the target's vocab size 1024"),
        ({"mask_token_id": 0, "aux_layer_ids": [0, 3]}, "aux layer id 0 .* cannot be a DFlash context layer"),
        ({"mask_token_id": 0, "aux_layer_ids": [4, 2]}, r"aux layer ids \[4, 2\] are not in increasing order"),
        ({"mask_token_id": 0, "aux_layer_ids": [2, 8]}, "aux layer id 8 is the final pre-norm state"),
    ],
)
def test_what_sglang_would_refuse_of_a_drafter_fails_the_first_task_naming_it(
    tmp_path: Path, random_tiny_model: Path, entry: dict[str, Any], words: str
) -> None:
    """Settings only the verifier's folder can judge (its vocabulary, its depth) fail the run's first task, by the
    drafter's family's own rules, not the training or the export hours later."""
    from operators.server import PlanEnginesOperator
    from operators.step import ParamsRefused

    (tmp_path / "in.jsonl").write_text("")
    params = base(tmp_path, random_tiny_model, drafters=["eagle3", {"name": "b", "draft_algorithm": "dflash", **entry}])
    with pytest.raises(ParamsRefused, match=rf"^Param drafters \(b\) \(dflash for .*\): {words}"):
        PlanEnginesOperator(task_id="plan_engines").execute({"params": params, "run_id": "manual__x"})  # type: ignore[arg-type]
    assert not (tmp_path / "runs").exists()


def test_a_template_switch_apply_chat_template_owns_fails_the_first_task(tmp_path: Path, random_tiny_model: Path) -> None:
    from eagleflow.run.param_checks import check_against_verifier

    cfg = PipelineConfig.from_params(base(tmp_path, random_tiny_model, chat_template_kwargs={"add_generation_prompt": True}))
    with pytest.raises(UserError, match=r"^Param chat_template_kwargs .*'add_generation_prompt' is an argument of apply_chat_template"):
        check_against_verifier(cfg)


def test_an_entry_naming_only_its_family_takes_its_familys_defaults_beside_the_runs(tmp_path: Path, random_tiny_model: Path) -> None:
    """The form's demo defaults (EAGLE-3's chain sweep and reduced vocabulary, run-wide) with ``["eagle3", "dflash"]``:
    the DFlash takes its own family's defaults for what is a family's (its block's sweep, the full vocabulary, its
    block size), and passes the first task's checks on a verifier whose full vocabulary leaves SGLang no room to add
    a mask token (the pad token is chosen, and written into the export)."""
    from eagleflow.demo import DEMO_PARAMS
    from eagleflow.run.param_checks import check_against_verifier
    from eagleflow.sglang_rules import BlockRuleError, choose_mask_token_id, resolve_mask_token_id
    from eagleflow.verifier import load_tokenizer

    cfg = PipelineConfig.from_params({**base(tmp_path, random_tiny_model), **DEMO_PARAMS, "drafters": ["eagle3", "dflash"]})
    check_against_verifier(cfg)
    eagle, dflash = (cfg.for_drafter(d) for d in cfg.drafter_plan())
    assert eagle.evaluate_config().eval_configs == DEMO_PARAMS["eval_configs"]
    assert eagle.train_config().draft_vocab_size == DEMO_PARAMS["draft_vocab_size"]
    assert dflash.evaluate_config().eval_configs == ""  # its own default sweep: its block, 1 and eval_concurrency in flight
    trained = dflash.train_config()
    assert (trained.block_size, trained.draft_vocab_size) == (16, train_default("draft_vocab_size"))
    # The tiny tokenizer is full (1024 ids, no <|MASK|>): SGLang could not add one; its pad token is chosen.
    tokenizer = load_tokenizer(random_tiny_model)
    with pytest.raises(BlockRuleError, match="not below the target's vocab size 1024"):
        resolve_mask_token_id(tokenizer, 1024)
    assert choose_mask_token_id(tokenizer, 1024) == (0, "the pad token: mask token id 1024 is not below the target's vocab size 1024")
    assert tokenizer.pad_token_id == 0
    assert choose_mask_token_id(tokenizer, 1024, 5) == (5, "as given")  # a given id is SGLang's to check


def train_default(name: str) -> Any:
    from eagleflow.train import TrainConfig

    return TrainConfig.model_fields[name].default
