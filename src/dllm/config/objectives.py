"""Objective sections, one per training objective, told apart by `name`."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from dllm.config.base import Float, Int, OutputFolder, RelPath, Section
from dllm.config.drafter import DrafterArchitecture
from dllm.config.registries import SCHEDULES


class CertaintyConfig(Section):
    """Certainty forcing (dParallel, Chen et al. 2025): a loss term that sharpens the masked predictions the model
    already gets right, so more of them pass a confidence threshold in one decoding step."""

    weight: Float = Field(default=1.0, gt=0)
    """Coefficient of the entropy term, summed over the right rows and normalised like the CE (per target)."""
    temperature: Float = Field(default=0.5, gt=0)
    """The entropy is that of softmax(logits / temperature) (dParallel: 0.5)."""


class MDLMConfig(Section):
    """Masked diffusion (MDLM / LLaDA): t ~ U(eps, 1] per sequence, CE on masked tokens weighted by w(t)."""

    name: Literal["mdlm"] = "mdlm"
    """Objective: mdlm (masked diffusion, loss weighted by the schedule's ELBO weight)."""
    schedule: Literal[SCHEDULES.names()] = "linear"  # type: ignore[valid-type]
    """Noise schedule alpha(t): linear (alpha = 1 - t, weight 1/t) or cosine."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Smallest noise level: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify t over the global batch (t_i = frac(u + i/B)) to reduce loss variance."""
    normalize: Literal["token", "sequence"] = "token"
    """Loss normaliser: supervised tokens of the global batch, or each sequence by its own count (SFT)."""
    certainty: CertaintyConfig | None = None
    """Certainty forcing: add the entropy of the masked predictions the model already gets right (none: off)."""

    def decode_facts(self) -> dict[str, Any]:
        """How models trained with this objective decode (see config/profile.py)."""
        return {"attention": "bidirectional", "schedule": self.schedule, "corruption": "mask"}


class BD3LMConfig(Section):
    """Block diffusion (BD3LM, Arriola et al. 2025): [x_t ; x_0] under the block-diffusion mask."""

    name: Literal["bd3lm"] = "bd3lm"
    """Objective: bd3lm (block diffusion; loss on the noisy half only)."""
    block_size: Int = Field(default=16, gt=0)
    """Tokens per block; must divide data.seq_len."""
    schedule: Literal[SCHEDULES.names()] = "linear"  # type: ignore[valid-type]
    """Noise schedule alpha(t) and its ELBO weight."""
    eps_min: Float = Field(default=1e-3, gt=0, le=1)
    """Lower end of the noise interval: t ~ U[eps_min, eps_max] per block (BD3LM's clipped schedule)."""
    eps_max: Float = Field(default=1.0, gt=0, le=1)
    """Upper end of the noise interval."""
    antithetic: bool = True
    """Stratify t over the global batch x blocks."""
    corruption: Literal["mask", "uniform"] = "mask"
    """Noise: the mask token, or uniformly random tokens (block-wise uniform-state diffusion)."""
    shift: bool = False
    """Predict token i from the hidden state at i-1 (AR-initialised models); a block start from the clean half."""
    certainty: CertaintyConfig | None = None
    """Certainty forcing: add the entropy of the masked predictions the model already gets right (none: off)."""

    @model_validator(mode="after")
    def _check_interval(self) -> BD3LMConfig:
        if self.eps_min >= self.eps_max:
            raise ValueError(f"eps_min {self.eps_min} must be below eps_max {self.eps_max}")
        return self

    def decode_facts(self) -> dict[str, Any]:
        """Block-causal decoding with the training block size; the token shift if trained with it."""
        return {"attention": "block", "block_size": self.block_size, "shift": self.shift,
                "schedule": self.schedule, "corruption": self.corruption}  # fmt: skip


class FastDLLMv2Config(Section):
    """Fast-dLLM v2 (Wu et al. 2025): block diffusion from an AR model with complementary masks."""

    name: Literal["fast_dllm_v2"] = "fast_dllm_v2"
    """Objective: fast_dllm_v2 (every supervised token is masked in exactly one of two views)."""
    block_size: Int = Field(default=32, gt=0)
    """Tokens per block; must divide data.seq_len."""
    sub_block_size: Int = Field(default=8, gt=0)
    """Sub-block decoded in parallel inside a block at sampling time (recorded for the sampler)."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Smallest mask ratio of a block: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify the mask ratio over the global batch x blocks."""
    shared_clean: bool | None = None
    """Both views in one row [x_t^1 ; x_t^2 ; x_0] (3L rows, the loss of two 2L rows); None: where layers allow."""
    certainty: CertaintyConfig | None = None
    """Certainty forcing: add the entropy of the masked predictions the model already gets right (none: off)."""

    @model_validator(mode="after")
    def _check_sub_block(self) -> FastDLLMv2Config:
        if self.block_size % self.sub_block_size:
            raise ValueError(f"sub_block_size {self.sub_block_size} must divide block_size {self.block_size}")
        return self

    def decode_facts(self) -> dict[str, Any]:
        """Block-causal decoding in sub-blocks, AR token shift; the mask ratio t ~ U(eps, 1] is the linear schedule."""
        return {"attention": "block", "block_size": self.block_size, "sub_block_size": self.sub_block_size,
                "shift": True, "schedule": "linear", "corruption": "mask"}  # fmt: skip


class NemotronDiffusionConfig(Section):
    """Nemotron-Labs-Diffusion (NVIDIA): a diffusion loss on x_t and a next-token loss on x_0 in one forward."""

    name: Literal["nemotron_diffusion"] = "nemotron_diffusion"
    """Objective: nemotron_diffusion ([x_t ; x_0] with a token-causal x_0; diffusion + AR loss)."""
    block_size: Int = Field(default=64, gt=0)
    """Tokens per block of x_t (the published recipe: 64); must divide data.seq_len."""
    diffusion_weight: Float = Field(default=0.3, ge=0)
    """Weight of the diffusion term: x_t's masked tokens, CE / p (published: 0.3)."""
    ar_weight: Float = Field(default=1.0, ge=0)
    """Weight of the next-token term on x_0 (published: 1.0)."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Smallest mask ratio: p = eps + (1 - eps) u per sequence, u ~ U[0, 1)."""
    antithetic: bool = False
    """Stratify u over the global batch (the published recipe draws it independently)."""
    normalize: Literal["sequence", "token"] = "sequence"
    """sequence: each row over its own count of terms, rows averaged (published); token: over all next-token targets."""

    @model_validator(mode="after")
    def _check_weights(self) -> NemotronDiffusionConfig:
        if self.diffusion_weight == 0 and self.ar_weight == 0:
            raise ValueError("diffusion_weight and ar_weight are both 0: nothing would be trained")
        return self

    def decode_facts(self) -> dict[str, Any]:
        """Block decoding with the training block size, no shift, and the context (prompt, committed blocks)
        read token-causally as the clean half was trained."""
        return {"attention": "block", "block_size": self.block_size, "shift": False, "causal_context": True,
                "schedule": "linear", "corruption": "mask"}  # fmt: skip


class UniformConfig(Section):
    """Uniform-state diffusion: tokens replaced by random vocabulary ids with probability 1 - alpha(t)."""

    name: Literal["uniform"] = "uniform"
    """Objective: uniform (no mask token; x0-prediction cross-entropy on every supervised token)."""
    schedule: Literal[SCHEDULES.names()] = "linear"  # type: ignore[valid-type]
    """Noise schedule alpha(t)."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Smallest noise level: t ~ U(eps, 1]."""
    antithetic: bool = True
    """Stratify t over the global batch."""
    self_condition_prob: Float = Field(default=0.0, ge=0, lt=1)
    """Chance a row is conditioned on a detached first pass's predictions (needs model.self_condition)."""

    def decode_facts(self) -> dict[str, Any]:
        """Bidirectional decoding without a mask token: uniform re-noising."""
        return {"attention": "bidirectional", "schedule": self.schedule, "corruption": "uniform"}


class DiffusionGemmaSFTConfig(Section):
    """DiffusionGemma's native SFT: every response block uniformly corrupted at once, scored in one pass
    beside the clean stream's next-token (encoder) loss."""

    name: Literal["diffusiongemma_native_sft"] = "diffusiongemma_native_sft"
    """Objective: diffusiongemma_native_sft (needs a diffusion_gemma model)."""
    block_size: Int = Field(default=256, gt=0)
    """Canvas length: response blocks of this many tokens from the response's start (the model's canvas)."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Smallest corruption probability of a block: t ~ U(eps, 1] per block."""
    antithetic: bool = True
    """Stratify t over the global batch x blocks."""
    encoder_loss_weight: Float = Field(default=1.0, ge=0)
    """Weight of the clean stream's next-token loss (the encoder's) beside the canvas loss (weight 1)."""
    self_condition_prob: Float = Field(default=0.5, ge=0, lt=1)
    """Chance an example's canvas is conditioned on a detached first pass's logits (drawn per example)."""

    def decode_facts(self) -> dict[str, Any]:
        """Canvases of block_size after the encoded prefix, uniform-state noise (no mask token)."""
        return {"attention": "prefix_canvas", "block_size": self.block_size, "corruption": "uniform"}


class ARConfig(Section):
    """Autoregressive next-token training under a causal mask (a speculative-decoding target, an AR baseline)."""

    name: Literal["ar"] = "ar"
    """Objective: ar (next-token cross-entropy; hidden i-1 predicts token i; supervised tokens only)."""

    def decode_facts(self) -> dict[str, Any]:
        """Causal decoding, one token per forward (`dllm generate --ar`, or a drafter with `--draft`)."""
        return {"attention": "causal", "shift": True}


class EditFlowConfig(Section):
    """Edit Flows (Havasi et al. 2025): a CTMC of insertions, deletions and substitutions; variable length."""

    name: Literal["edit_flow"] = "edit_flow"
    """Objective: edit_flow (Bregman flow-matching loss on the edit rates; needs model.edit_head)."""
    kappa: Literal["cubic", "linear"] = "cubic"
    """Coupling schedule kappa(t): chance an aligned column already shows x_1 (cubic t^3, or linear t)."""
    x0: Literal["empty", "uniform"] = "empty"
    """Start of the completion: empty (learn insertions), or uniform random tokens as long as x_1."""
    eps: Float = Field(default=1e-3, gt=0, lt=1)
    """Largest time is 1 - eps: t ~ U[0, 1 - eps] (the weight kappa'/(1 - kappa) diverges at 1)."""
    antithetic: bool = True
    """Stratify t over the global batch."""
    time_sampling: Literal["uniform", "weight"] = "uniform"
    """uniform t, rows weighted by w(t) (the paper's), or t drawn in proportion to w(t) (K(t) uniform, equal rows)."""

    def decode_facts(self) -> dict[str, Any]:
        """Bidirectional edit-flow decoding (tau-leaping over the edit rates), no mask canvas."""
        return {"attention": "bidirectional", "generation": "edit_flow", "edit_kappa": self.kappa, "edit_eps": self.eps}


class DFlashDistillationConfig(Section):
    """DFlash drafter distillation (Chen et al. 2025): a drafter learns a frozen AR target's next tokens."""

    name: Literal["dflash_distillation"] = "dflash_distillation"
    """Objective: dflash_distillation (the trained model is a DFlash drafter of `target`)."""
    target: RelPath
    """The frozen causal target: a model folder (dllm convert, Hugging Face) or a run folder (newest checkpoint)."""
    target_layer_ids: list[Int] = Field(min_length=1)
    """Target blocks (0-based) whose outputs the drafter reads, e.g. spread from the second to the third-last."""
    block_size: Int = Field(default=8, ge=2)
    """b: draft block length (the anchor and b - 1 proposals); generation must use the same."""
    num_layers: Int = Field(default=1, gt=0)
    """Drafter blocks."""
    architecture: DrafterArchitecture = "dllm"
    """dflash: the published DFlash drafter (exports a folder SGLang and vLLM load); dllm: dllm's first drafters."""
    num_anchors: Int = Field(default=16, gt=0)
    """Draft blocks per training sequence, all in one forward (anchors drawn where the next token is supervised)."""
    loss: Literal["ce", "kl"] = "ce"
    """ce: cross-entropy to the target's greedy next tokens; kl: KL(target || drafter) of next-token distributions."""
    labels: Literal["target", "data"] = "target"
    """ce's next tokens: target (its argmax: a head pass per step) or data (the same on its own greedy answers)."""
    decay: Float | None = Field(default=7.0, gt=0)
    """gamma of the weight exp(-(k-1)/gamma) of the k-th proposal (early ones decide acceptance); null: all 1."""
    feature_cache: OutputFolder | None = None
    """Folder of the target's precomputed features (built by one pass when missing); null: run the target per step."""
    init_from_target: list[Int] | None = None
    """Target blocks (0-based, one per drafter block) copied into the drafter's, with the final norm; null: random."""

    @model_validator(mode="after")
    def _labels_of_ce(self) -> DFlashDistillationConfig:
        if self.labels == "data" and self.loss == "kl":
            raise ValueError("labels: data gives next tokens, not the target's distribution that loss kl needs; "
                             "use loss ce or labels target")  # fmt: skip
        init = self.init_from_target
        if init is not None and len(init) != self.num_layers:
            raise ValueError(f"init_from_target names {len(init)} target blocks for {self.num_layers} drafter blocks "
                             "(num_layers): name one per drafter block")  # fmt: skip
        if init is not None and self.architecture != "dllm":
            raise ValueError(f"init_from_target copies target blocks, which only architecture dllm's blocks (the "
                             f"target's layout) can take, not {self.architecture}'s; leave it unset")  # fmt: skip
        return self

    def decode_facts(self) -> dict[str, Any]:
        """A drafter's block is bidirectional; it is never sampled alone (only with its target, `--draft`)."""
        return {"attention": "bidirectional"}


ObjectiveConfig = Annotated[
    MDLMConfig
    | BD3LMConfig
    | FastDLLMv2Config
    | NemotronDiffusionConfig
    | UniformConfig
    | ARConfig
    | EditFlowConfig
    | DFlashDistillationConfig
    | DiffusionGemmaSFTConfig,
    Field(discriminator="name"),
]
