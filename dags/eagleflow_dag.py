"""eagleflow: base LLM served by SGLang -> hidden states -> trained drafter (EAGLE-3 or DFlash).

The story of docs/design.md §1, top to bottom:

1. plan_engines lists the run's engines; launch_server and wait_server_ready (setups, one
   instance per engine) start each with the capture hook and wait out its warmup without
   holding a worker slot;
2. meanwhile prepare_dataset, dataset_stats, check_disk and plan_shards get the rows ready
   (with regenerate_responses, regenerate_dataset first has the verifier rewrite the answers
   through the first engine this worker reaches);
3. verify_capture (a setup too, one instance per engine) checks each live engine's capture on
   the first rows;
4. extract_shard runs once per shard (rows_0-2000, …) on one of the engines, each retryable
   (on an engine that is up) and clearable alone;
5. stop_server (teardown, one instance per engine) stops the engines, even when a shard fails;
6. build_vocab, train_drafter and plot_metrics turn the hidden states into a drafter of the family
   draft_algorithm names (eagle3, eagle3.1 or the block drafter dflash) and charts, or into each drafter
   the drafters Param lists, all from the one capture (plan_drafters; train_drafter: one instance per
   drafter and training node, eagle3, dflash/node-1, …, planned by plan_train_nodes; the others one
   instance per drafter).
   Online (hidden_states_source engine) no shard is extracted (each instance is skipped, saying
   why), the engines stay up, train_drafter asks them for each sample while it trains, and
   stop_server_after_training stops them once it is done, however it ended;
7. export_drafter writes each drafter as SGLang and vLLM load it, evaluate_drafter serves it, measuring
   accept length and speedup on held-out prompts, and compare_drafters puts the drafters side by side
   and names the fastest for each batch size.

Each DAG run's page has an "eagleflow run" tab (the UI plugin, plugins/): its run folder's page, the
comparison of its drafters first.
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
from operators.drafter import CompareOperator, EvaluateOperator, ExportOperator
from operators.extract import (
    PLAN_SHARDS_TASK_ID,
    SHARD_MAP_INDEX_TEMPLATE,
    SHARD_RETRIES,
    SHARD_RETRY_DELAY,
    ShardExtractOperator,
    VerifyCaptureOperator,
)
from operators.params import DAG_ID, GPU_POOL, GPU_QUEUE, PLAN_DRAFTERS_TASK_ID, form_defaults, pipeline_params
from operators.server import (
    ENGINE_MAP_INDEX_TEMPLATE,
    SERVER_MAP_INDEX_TEMPLATE,
    WAIT_RETRIES,
    WAIT_RETRY_DELAY,
    PlanEnginesOperator,
    ServerReadySensor,
    SGLangServerOperator,
    StopServerOperator,
)
from operators.train import (
    DRAFTER_MAP_INDEX_TEMPLATE,
    NODE_MAP_INDEX_TEMPLATE,
    TRAIN_RETRIES,
    TRAIN_RETRY_DELAY,
    BuildVocabOperator,
    PlanDraftersOperator,
    PlanTrainNodesOperator,
    PlotOperator,
    TrainOperator,
)

with DAG(
    dag_id=DAG_ID,
    description="Train a speculative-decoding drafter (EAGLE-3 or DFlash) from a base model served by SGLang",
    schedule=None,
    catchup=False,
    max_active_runs=1,
    params={name: Param(**schema) for name, schema in pipeline_params(form_defaults()).items()},
    tags=["eagleflow", "speculative-decoding"],
    doc_md=__doc__,
) as dag:
    # The engines, extraction, training and evaluation run on the GPU node(s): their Celery queue and pool.
    on_gpu = {"queue": GPU_QUEUE, "pool": GPU_POOL}

    # One instance per engine (map_index_template must be given to partial(): the scheduler and
    # the task runner read it from the mapped task's partial kwargs, never from __init__).
    plan_engines = PlanEnginesOperator(task_id="plan_engines")
    launch_server = SGLangServerOperator.partial(
        task_id="launch_server", map_index_template=ENGINE_MAP_INDEX_TEMPLATE, **on_gpu
    ).expand(engine=plan_engines.output)
    wait_server_ready = ServerReadySensor.partial(
        task_id="wait_server_ready", map_index_template=SERVER_MAP_INDEX_TEMPLATE,
        retries=WAIT_RETRIES, retry_delay=WAIT_RETRY_DELAY, **on_gpu
    ).expand(server=launch_server.output)

    # On the GPU queue: a launched engine listens on its GPU node's 127.0.0.1 only. No GPU pool
    # slot: it only sends requests, and with regeneration off it returns at once.
    regenerate_dataset = RegenerateOperator(task_id="regenerate_dataset", engines=launch_server.output, queue=GPU_QUEUE)
    prepare_dataset = PrepareDatasetOperator(task_id="prepare_dataset")
    dataset_stats = DatasetStatsOperator(task_id="dataset_stats")
    check_disk = CheckDiskOperator(task_id="check_disk", stats=dataset_stats.output)
    plan_shards = PlanShardsOperator(task_id=PLAN_SHARDS_TASK_ID, prepared=prepare_dataset.output)

    # Each engine's capture checked live before hours of extraction (a setup: a restarted engine is re-checked).
    verify_capture = VerifyCaptureOperator.partial(
        task_id="verify_capture", map_index_template=SERVER_MAP_INDEX_TEMPLATE, **on_gpu
    ).expand(server=wait_server_ready.output)

    extract_shard = ShardExtractOperator.partial(
        task_id="extract_shard",
        engines=wait_server_ready.output,
        map_index_template=SHARD_MAP_INDEX_TEMPLATE,
        retries=SHARD_RETRIES,
        retry_delay=SHARD_RETRY_DELAY,
        **on_gpu,
    ).expand(shard=plan_shards.output)

    stop_server = StopServerOperator.partial(
        task_id="stop_server", map_index_template=ENGINE_MAP_INDEX_TEMPLATE, **on_gpu
    ).expand(engine=plan_engines.output)

    # none_failed: online, every shard is skipped and training goes on without them.
    build_vocab = BuildVocabOperator(task_id="build_vocab", trigger_rule="none_failed")
    # One instance per drafter (the drafters Param; one by default) and training node, all at once: a drafter's
    # nodes meet in its folder and train as one torchrun group; each drafter is cleared and retried on its own.
    plan_drafters = PlanDraftersOperator(task_id=PLAN_DRAFTERS_TASK_ID)
    plan_train_nodes = PlanTrainNodesOperator(task_id="plan_train_nodes", drafters=plan_drafters.output)
    train_drafter = TrainOperator.partial(
        task_id="train_drafter", engines=wait_server_ready.output, map_index_template=NODE_MAP_INDEX_TEMPLATE,
        retries=TRAIN_RETRIES, retry_delay=TRAIN_RETRY_DELAY, **on_gpu
    ).expand(node=plan_train_nodes.output)
    # Online the engines serve training: stopped here (all_done: whatever training's outcome).
    stop_server_after_training = StopServerOperator.partial(
        task_id="stop_server_after_training", map_index_template=ENGINE_MAP_INDEX_TEMPLATE, after_training=True,
        trigger_rule="all_done", **on_gpu
    ).expand(engine=plan_engines.output)
    # all_done: one drafter's failure holds back no other drafter; each instance checks its own drafter's
    # upstream result, and compare_drafters fails the run naming a drafter that was not measured.
    per_drafter = {"map_index_template": DRAFTER_MAP_INDEX_TEMPLATE, "trigger_rule": "all_done"}
    plot_metrics = PlotOperator.partial(task_id="plot_metrics", **per_drafter).expand(drafter=plan_drafters.output)
    export_drafter = ExportOperator.partial(task_id="export_drafter", **per_drafter).expand(drafter=plan_drafters.output)
    evaluate_drafter = EvaluateOperator.partial(task_id="evaluate_drafter", **per_drafter, **on_gpu).expand(
        drafter=plan_drafters.output
    )
    compare_drafters = CompareOperator(task_id="compare_drafters", drafters=plan_drafters.output, trigger_rule="all_done")

    regenerate_dataset >> prepare_dataset >> dataset_stats >> check_disk >> plan_shards
    engine_setups = [launch_server, wait_server_ready, verify_capture]
    launch_server >> wait_server_ready >> verify_capture >> extract_shard >> stop_server.as_teardown(setups=engine_setups)
    prepare_dataset >> verify_capture
    check_disk >> extract_shard
    [extract_shard, stop_server] >> build_vocab >> plan_train_nodes >> train_drafter >> plot_metrics
    train_drafter >> stop_server_after_training
    train_drafter >> export_drafter >> evaluate_drafter >> compare_drafters
    # plan_engines checks every Param first: nothing else starts before it passes, and after a refusal every task
    # says it could not run (upstream_failed) and compare_drafters, the last, gives the refusal's sentence.
    plan_engines >> plan_drafters
