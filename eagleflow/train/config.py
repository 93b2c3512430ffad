"""Flags of ``python -m eagleflow train``, declared once; defaults are the seed run's."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from eagleflow.config import AuxLayerIds, SampleStoreAddress, DraftVocabSize, StoredHiddenStatesDtype
from eagleflow.drafters import DraftAlgorithm
from eagleflow.sglang_rules import ServingEngine
from eagleflow.extract import ExtractConfig

HiddenStatesSource = Literal["disk", "engine"]

# Flags whose change between a run and its resume would silently change the model or the
# learning-rate schedule (speculators would stretch or cut the cosine over a new total).
RESUME_MUST_MATCH = (
    "aux_layer_ids",
    "epochs",
    "lr",
    "scheduler_type",
    "scheduler_warmup_ratio",
    "optimizer",
    "total_seq_len",
    "ttt_steps",
    "train_data_ratio",
    "draft_vocab_size",
    "num_layers",
    "draft_config",
    "serve_with",
    "draft_algorithm",
    "block_size",
    "markov_rank",
    "markov_head_type",
)


class TrainConfig(BaseModel):
    """Flags of ``python -m eagleflow train``; defaults are the seed run's hyperparameters."""

    dataset: Path = Field(description="training dataset folder with hidden_states/ (docs/design.md §3.3)")
    verifier: Path = Field(description="verifier model folder (config.json + safetensors)")
    out: Path = Field(description="training folder: checkpoints/, metrics.jsonl, train.log, result.json")
    aux_layer_ids: AuxLayerIds = Field(
        description="the drafter's aux layer ids (speculators --target-layer-ids)"
    )
    captured_aux_layer_ids: AuxLayerIds | None = Field(
        None,
        description="the layer ids the samples were captured for, when more than this drafter's (one capture for "
        "several drafters): the drafter reads its own layers' slots; empty: --aux-layer-ids",
    )
    epochs: int = Field(5, ge=1, title="Epochs", description="training epochs; resume with the same count")
    lr: float = Field(3e-5, gt=0, title="Learning rate", description="peak learning rate (AdamW)")
    total_seq_len: int = Field(2048, ge=16, title="Packed sequence length (tokens)", description="tokens packed into one training sequence")
    ttt_steps: int = Field(3, ge=1, title="TTT steps", description="test-time-training steps the draft is unrolled over")
    noise_std: float = Field(
        0.05, ge=0, title="Noise on hidden states", description="noise added to training samples' aux hidden states: uniform in [-noise_std, noise_std]"
    )
    scheduler_type: Literal["cosine", "linear", "none"] = Field("cosine", title="Learning-rate schedule", description="learning-rate schedule")
    scheduler_warmup_ratio: float = Field(0.01, ge=0, le=1, title="Warmup share of steps", description="warmup as a fraction of all steps")
    num_workers: int = Field(4, ge=0, title="Data-loader workers", description="data-loader worker processes")
    draft_vocab_size: DraftVocabSize
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="optimizer; with muon, --lr applies to the AdamW group only"
    )
    num_layers: int | None = Field(
        None, ge=1, title="Draft decoder layers",
        description="draft decoder layers; empty: the family's default (eagle3 1, dflash 5, speculators' own); ignored with "
        "--draft-config",
    )
    draft_config: Path | None = Field(
        None, title="Draft layer config (JSON)", description="decoder config JSON (LlamaConfig) fixing the draft layer shape, e.g. for Kimi-K2.5"
    )
    train_data_ratio: float = Field(0.9, gt=0, lt=1, title="Training share of rows", description="fraction of rows trained on; the rest validates")
    serve_with: ServingEngine
    draft_algorithm: DraftAlgorithm = Field(
        "eagle3",
        title="Drafter family",
        description="eagle3: a chain of one-token draft steps, one RMSNorm over the concatenated aux states before fc. "
        "eagle3.1: the same with one RMSNorm per aux state (fc_norm, the EAGLE-3.1 paper's); SGLang serves eagle3.1 "
        "from 0.5.13, eagle3 from 0.5.17. dflash: a block drafter, one draft pass proposes block_size - 1 tokens "
        "(speculators 0.9.0, SGLang 0.5.23; full vocabulary). dspark: DFlash's block with a Markov head, each drafted "
        "token biased by the one drafted before it, and a confidence head; one pass drafts block_size tokens (speculators "
        "0.9.0, SGLang 0.5.23; full vocabulary). Not offered: dflash2, whose training objective is unpublished (README: "
        "drafter families)",
    )

    @field_validator("draft_algorithm", mode="before")
    @classmethod
    def _offered(cls, value: object) -> object:
        from eagleflow.drafters import family

        if isinstance(value, str):
            family(value)  # a family not offered is refused with its reason, not as a bad enum value
        return value

    block_size: int | None = Field(
        None, ge=2, le=64, title="Block size (block drafters)",
        description="block drafters: tokens per draft block. dflash: the bonus token and block_size - 1 drafts, verified "
        "as --speculative-num-draft-tokens block_size; dspark: block_size drafts (its bonus-token slot drafts too), "
        "verified with the bonus token as block_size + 1 (SGLang's --speculative-dspark-block-size). Empty: "
        "speculators' default (dflash 16, dspark 8)",
    )
    markov_rank: int | None = Field(
        None, ge=1, le=4096, title="Markov rank (DSpark)",
        description="dspark: rank of the Markov head, the low-rank logit bias each drafted token gets from the token "
        "drafted before it (markov_w1, markov_w2: vocabulary x rank each). Empty: speculators' default (256)",
    )
    markov_head_type: Literal["vanilla", "gated", "rnn"] | None = Field(
        None, title="Markov head type (DSpark)",
        description="dspark: vanilla, a bias from the previous token alone; gated, that bias gated by the draft's hidden "
        "state; rnn, a recurrent state carried along the block (SGLang 0.5.23 serves all three). Empty: speculators' "
        "default (vanilla)",
    )
    mask_token_id: int | None = Field(
        None, ge=0, title="Mask token id (block drafters)",
        description="block drafters: the token whose embedding fills the draft block after the bonus token. Empty: "
        "resolved from the verifier's tokenizer as SGLang resolves it (its <|MASK|> token, or the id adding one gives, "
        "which must be below the vocabulary size), else its pad token; the export writes the id, so SGLang serves the same one",
    )
    max_anchors: int = Field(
        512, ge=1, title="Blocks per packed sequence (block drafters)",
        description="block drafters: anchors (blocks) trained per packed sequence, drawn at random among its loss-masked "
        "positions (speculators --max-anchors)",
    )
    log_freq: int = Field(1, ge=1, description="log a metrics record every N steps")
    seed: int = Field(42, description="random seed")
    trust_remote_code: bool = Field(False, description="let transformers run the verifier's own config code")
    compute_dtype: Literal["bfloat16", "float32"] = Field(
        "bfloat16",
        description="dtype hidden states are trained in (speculators --hidden-states-dtype); storage is the dataset's. "
        "Block drafters on CPU train in float32 (speculators turns autocast off there)",
    )
    loss_implementation: Literal["auto", "fused", "eager"] = Field(
        "auto", description="speculators loss kernel; auto: fused on GPU, eager on CPU"
    )
    draft_attn_impl: Literal["auto", "simple_flex_attention", "sdpa", "eager"] = Field(
        "auto", description="draft attention; auto: simple_flex_attention on GPU, sdpa on CPU"
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", title="Training device", description="where to train; auto: cuda when available")
    gpus: int | None = Field(None, ge=1, title="Training GPUs", description="GPUs to train on (torchrun when more than one); default: all")
    restart: bool = Field(False, title="Restart training from scratch", description="start from scratch; the old run moves to OUT/previous/<time>/")
    # Several nodes: one torchrun per node, ranks data-parallel (eagleflow.train.nodes).
    train_nodes: int = Field(
        1, ge=1, le=64, title="Training nodes",
        description="nodes that train together (torchrun across them, data-parallel): one train_drafter instance "
        "per node on the GPU queue, all started at once (give the gpu pool a slot per node); every node must see the "
        "run folder at the same path (checkpoints are shared) and reach node-0",
    )
    node_rank: int = Field(0, ge=0, description="which of --train-nodes this is (node-0 prepares the folder and hosts the rendezvous)")
    rendezvous_timeout: float = Field(
        600.0, gt=0, title="Training nodes: rendezvous timeout (s)",
        description="several nodes: seconds a node waits for the others to join before it fails naming those missing",
    )
    node_address: str | None = Field(
        None, description="several nodes: the address the others reach node-0 at; default: $EAGLEFLOW_NODE_ADDRESS, else the host's name"
    )
    collective_timeout: float = Field(
        600.0, gt=0, description="several ranks: seconds a collective waits for a peer that neither answers nor closes its connection"
    )
    lock_wait: float = Field(
        30.0, ge=0, description="seconds to wait for another trainer working in --out to exit before refusing (one trainer per folder)"
    )
    # Online training: the hidden states come from the live engines while training runs.
    hidden_states_source: HiddenStatesSource = Field(
        "disk",
        title="Hidden-states source",
        description="disk: extract every shard first and train from the files. engine: no extraction; the engines "
        "stay up through training, which asks them for each sample shortly before it needs it, checks it as "
        "extraction does and deletes it after use, so the disk holds at most a budget whatever the dataset's size "
        "(speculators 0.9.0)",
    )
    online_prefetch: int = Field(
        8, ge=1, le=256, title="Online: samples in flight",
        description="engine mode: samples requested ahead of the trainer, spread over the run's engines",
    )
    online_cache_gb: float = Field(
        0.0, ge=0, title="Online: cache (GB)",
        description="engine mode: keep samples up to this many GB on disk for later epochs (0: every epoch asks the "
        "engines again)",
    )
    online_trainers: list[Path] = Field(
        default_factory=list,
        description="engine mode with several drafters: every drafter's training folder, in the run's order; the "
        "first one's feed asks the engines and hands each sample to the others (one prefill for all)",
    )
    online_peer_wait: float = Field(
        600.0, gt=0,
        description="engine mode with several drafters: seconds a pass waits for another drafter's trainer before "
        "it goes on without it (that one then fetches its own samples)",
    )
    online_window_gb: float | None = Field(
        None, gt=0,
        description="engine mode: disk the samples fetched ahead of the trainer may take (dumps + ready samples; one "
        "sample always may go); default: the engines' dump queue budget",
    )
    engine_urls: list[str] = Field(
        default_factory=list, description="engine mode: the engines to ask, e.g. http://127.0.0.1:30000"
    )
    engine_names: list[str] = Field(default_factory=list, description="engine mode: their names (engine-0, …), for the log")
    dump_dir: Path | None = Field(None, description="engine mode: the folder the engines' capture writes dumps to")
    sample_store: SampleStoreAddress
    hidden_states_dtype: StoredHiddenStatesDtype
    engine_wait: float = Field(
        120.0, ge=0,
        description="engine mode: seconds the trainer waits for an engine to be ready again when none is, before "
        "it stops naming them (a retry resumes from the last checkpoint); above the warmup if engines may restart",
    )
    request_timeout: float = ExtractConfig.model_fields["request_timeout"]
    max_retries: int = ExtractConfig.model_fields["max_retries"]
    dump_wait: float = ExtractConfig.model_fields["dump_wait"]

    @model_validator(mode="after")
    def _family_defaults(self) -> TrainConfig:
        """The chosen family's defaults for what was left empty (concrete values: a resume compares them)."""
        from eagleflow.drafters import FAMILY_SETTINGS, check_family_settings

        chosen = check_family_settings(self.draft_algorithm, self.block_size, **{name: getattr(self, name) for name in FAMILY_SETTINGS})
        if self.num_layers is None:
            self.num_layers = chosen.default_layers
        if chosen.block and self.block_size is None:
            self.block_size = chosen.default_block_size
        for name, default in chosen.settings.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        return self

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.device == "cpu" and self.gpus is not None:
            raise ValueError("--gpus does not apply with --device cpu")
        if self.engine_names and len(self.engine_names) != len(self.engine_urls):
            raise ValueError("--engine-names must name each of --engine-urls")
        if self.node_rank >= self.train_nodes:
            raise ValueError(f"--node-rank {self.node_rank} is not one of --train-nodes {self.train_nodes} (0..{self.train_nodes - 1})")
        if self.train_nodes > 1 and self.hidden_states_source == "engine":
            raise ValueError("--train-nodes above 1 trains from the extracted files only (--hidden-states-source disk)")
        self.sample_slots  # noqa: B018 - this drafter's layers must be among those captured
        return self

    @property
    def captured(self) -> list[int]:
        """The layer ids each sample holds (the capture's, else this drafter's own)."""
        return list(self.captured_aux_layer_ids or self.aux_layer_ids)

    @property
    def sample_slots(self) -> list[int] | None:
        """The slots of a sample this drafter reads, when the capture holds more than its layers (else None: all)."""
        from eagleflow.drafters import slots_of

        if self.captured == list(self.aux_layer_ids):
            return None
        try:
            return slots_of(self.aux_layer_ids, self.captured)
        except ValueError as exc:
            raise ValueError(f"--aux-layer-ids: {exc} (--captured-aux-layer-ids)") from exc
