"""eagleflow: base LLM served by SGLang -> hidden states -> trained EAGLE-3 drafter.

The story of DESIGN.md §1, top to bottom:

1. launch_server and wait_server_ready (setups) start the engine with the capture hook and
   wait out its warmup without holding a worker slot;
2. meanwhile prepare_dataset, dataset_stats, check_disk and plan_shards get the rows ready
   (with regenerate_responses, regenerate_dataset first has the verifier rewrite the answers);
3. verify_capture (a setup too) checks the live engine's capture on the first rows;
4. extract_shard runs once per shard (rows_0-2000, …), each retryable and clearable alone;
5. stop_server (teardown) stops the engine, even when a shard fails;
6. build_vocab, train_drafter and plot_metrics turn the hidden states into a drafter and charts;
7. export_drafter writes the drafter as SGLang and vLLM load it, and evaluate_drafter serves it,
   measuring accept length and speedup on held-out prompts.
"""

from __future__ import annotations

from airflow.sdk import DAG, Param

from operators.dataset import (
    CheckDiskOperator,
    DatasetStatsOperator,
    PlanShardsOperator,
    PrepareDatasetOperator,
    RegenerateOperator,
)
from operators.drafter import EvaluateOperator, ExportOperator
from operators.extract import SHARD_MAP_INDEX_TEMPLATE, ShardExtractOperator, VerifyCaptureOperator
from operators.params import GPU_POOL, GPU_QUEUE, form_defaults, pipeline_params
from operators.server import ServerReadySensor, SGLangServerOperator, StopServerOperator
from operators.train import BuildVocabOperator, PlotOperator, TrainOperator

with DAG(
    dag_id="eagleflow",
    description="Train an EAGLE-3 drafter from a base model served by SGLang",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    params={name: Param(**schema) for name, schema in pipeline_params(form_defaults()).items()},
    tags=["eagleflow", "speculative-decoding"],
    doc_md=__doc__,
) as dag:
    # The engine, extraction, training and evaluation run on the GPU node: its Celery queue, one slot.
    on_gpu = {"queue": GPU_QUEUE, "pool": GPU_POOL}

    launch_server = SGLangServerOperator(task_id="launch_server", **on_gpu)
    wait_server_ready = ServerReadySensor(task_id="wait_server_ready", server=launch_server.output, **on_gpu)

    regenerate_dataset = RegenerateOperator(task_id="regenerate_dataset", server=launch_server.output)
    prepare_dataset = PrepareDatasetOperator(task_id="prepare_dataset")
    dataset_stats = DatasetStatsOperator(task_id="dataset_stats")
    check_disk = CheckDiskOperator(task_id="check_disk", stats=dataset_stats.output)
    plan_shards = PlanShardsOperator(task_id="plan_shards", prepared=prepare_dataset.output)

    # The capture checked on the live engine before hours of extraction (a setup: a restarted engine is re-checked).
    verify_capture = VerifyCaptureOperator(task_id="verify_capture", server=wait_server_ready.output, **on_gpu)

    # map_index_template must be given to partial(): the scheduler and the task runner read it
    # from the mapped task's partial kwargs, never from the operator's __init__.
    extract_shard = ShardExtractOperator.partial(
        task_id="extract_shard", server=wait_server_ready.output, map_index_template=SHARD_MAP_INDEX_TEMPLATE, **on_gpu
    ).expand(shard=plan_shards.output)

    stop_server = StopServerOperator(task_id="stop_server", server=launch_server.output, **on_gpu)

    build_vocab = BuildVocabOperator(task_id="build_vocab")
    train_drafter = TrainOperator(task_id="train_drafter", **on_gpu)
    plot_metrics = PlotOperator(task_id="plot_metrics")
    export_drafter = ExportOperator(task_id="export_drafter")
    evaluate_drafter = EvaluateOperator(task_id="evaluate_drafter", **on_gpu)

    regenerate_dataset >> prepare_dataset >> dataset_stats >> check_disk >> plan_shards
    engine_setups = [launch_server, wait_server_ready, verify_capture]
    launch_server >> wait_server_ready >> verify_capture >> extract_shard >> stop_server.as_teardown(setups=engine_setups)
    prepare_dataset >> verify_capture
    check_disk >> extract_shard
    [extract_shard, stop_server] >> build_vocab >> train_drafter >> plot_metrics
    train_drafter >> export_drafter >> evaluate_drafter
