"""Flags of ``python -m eagleflow serve-reference``, declared once (test-only faults are not flags: see
:mod:`eagleflow.engine.reference.faults`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from eagleflow.config import AuxLayerIds, SampleStoreAddress, StoredHiddenStatesDtype
from eagleflow.sglang_rules import check_block_flags, check_tree_flags


class ReferenceEngineConfig(BaseModel):
    """Flags of ``python -m eagleflow serve-reference``."""

    model: Path = Field(description="local folder of a transformers causal LM (config.json + safetensors)")
    dump_dir: Path | None = Field(
        None, description="folder the per-request hidden-state dumps <rid>.safetensors go to; none: serve without capturing"
    )
    aux_layers: AuxLayerIds | None = Field(
        None,
        description="layer ids to capture (with --dump-dir), comma-separated: id k = the state entering decoder layer k, "
        "n = the last layer's output before the final norm; the final pre-norm state is always added as the last slot",
    )
    hidden_states_dtype: StoredHiddenStatesDtype
    host: str = Field("127.0.0.1", description="address to bind (keep 127.0.0.1 unless a remote client must reach it)")
    port: int = Field(30000, ge=0, le=65535, description="TCP port to bind (SGLang's default 30000; 0 = any free port, printed at start)")
    warmup_seconds: float = Field(
        0.0, ge=0, description="simulated warmup: /health answers 503 this long after the model is loaded (one real forward runs meanwhile)"
    )
    context_length: int | None = Field(
        None, ge=2,
        description="SGLang's --context-length: the most tokens a request's prompt plus answer may take; "
        "default: derived from the model's config as SGLang derives it (never more than that)",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the model runs")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="model dtype; auto = the dtype in the model's config.json (dumps: --hidden-states-dtype)"
    )
    threads: int = Field(
        0, ge=0, description="CPU threads for torch (0 = torch's default, one per core); 1 avoids thrashing on a shared small machine"
    )
    trust_remote_code: bool = Field(False, description="allow the model folder's own modelling code (Kimi-K2.5 needs it)")
    # SGLang's speculative decoding flags (server_args), with the same names and meaning.
    speculative_algorithm: Literal["EAGLE3", "DFLASH", "DSPARK"] | None = Field(
        None,
        description="decode with the drafter of --speculative-draft-model-path (greedy requests only): EAGLE3 drafts a chain "
        "or tree of one-token steps, DFLASH a block of --speculative-num-draft-tokens in one pass, DSPARK a block of "
        "--speculative-dspark-block-size tokens in one pass, each biased by the token drafted before it",
    )
    speculative_draft_model_path: Path | None = Field(
        None, description="the drafter folder eagleflow export wrote for SGLang (drafter/sglang)"
    )
    speculative_num_steps: int = Field(3, ge=1, description="EAGLE3: draft steps per verification (DFLASH: 1)")
    speculative_eagle_topk: int = Field(
        1, ge=1, description="candidates kept per draft step: 1 drafts a chain, K > 1 a tree of the best-scoring branches"
    )
    speculative_num_draft_tokens: int | None = Field(
        None, ge=2,
        description="tokens verified per round (the last accepted one and the drafts): --speculative-num-steps + 1 for a "
        "chain (default); with --speculative-eagle-topk K > 1 the best M - 1 of the tree's K + (steps - 1) * K^2 candidates",
    )
    speculative_dflash_block_size: int | None = Field(
        None, ge=2, description="DFLASH: the block size; an alias of --speculative-num-draft-tokens, which it must equal"
    )
    speculative_dspark_block_size: int | None = Field(
        None, ge=1,
        description="DSPARK: gamma, the tokens drafted per round; the verify window --speculative-num-draft-tokens is "
        "gamma + 1 and must equal it when both are given (SGLang's rule). Default: from --speculative-num-draft-tokens, "
        "else the drafter's block_size",
    )
    speculative_draft_window_size: int | None = Field(
        None, ge=1, description="sliding window of the draft's attention (the drafter's, from the export)"
    )
    sample_store: SampleStoreAddress
    dump_queue_bytes: int | None = Field(
        None, ge=1,
        description="bytes of captured, not yet written dumps the engine may hold; past that, for 2s, a request "
        "gets a 'writer behind' error record instead of waiting (default: 1/8 of this host's memory, at most 32 GiB)",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ReferenceEngineConfig:
        if (self.dump_dir is None) != (self.aux_layers is None):
            raise ValueError("--dump-dir and --aux-layers go together: capture needs both")
        if self.speculative_algorithm and self.speculative_draft_model_path is None:
            raise ValueError(f"--speculative-algorithm {self.speculative_algorithm} needs --speculative-draft-model-path")
        if self.speculative_algorithm in ("DFLASH", "DSPARK"):
            if self.speculative_algorithm == "DFLASH":
                block = self.speculative_num_draft_tokens or self.speculative_dflash_block_size
                if self.speculative_dflash_block_size not in (None, block):
                    raise ValueError("--speculative-dflash-block-size must equal --speculative-num-draft-tokens (SGLang's rule)")
            else:  # the verify window: the bonus token and gamma drafts
                gamma = self.speculative_dspark_block_size
                block = self.speculative_num_draft_tokens or (gamma + 1 if gamma else None)
                if gamma is not None and block != gamma + 1:
                    raise ValueError(
                        f"--speculative-num-draft-tokens {block} must equal --speculative-dspark-block-size + 1 = {gamma + 1} "
                        "(SGLang's rule: the bonus token and the drafts)"
                    )
            given = self.model_fields_set  # SGLang forces steps and topk to 1; a different value given would be misread
            if block is not None:
                check_block_flags(
                    block, self.speculative_num_steps if "speculative_num_steps" in given else None,
                    self.speculative_eagle_topk if "speculative_eagle_topk" in given else None,
                )
            return self
        check_tree_flags(self.speculative_num_steps, self.speculative_eagle_topk, self.speculative_num_draft_tokens)
        return self
