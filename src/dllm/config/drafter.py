"""The DFlash drafter section: its blocks, the target layers it reads, and DFlash2's convolutions and
candidate selector (models/dflash.py, models/dflash2.py; the public layout: models/dflash_io.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dllm.config.base import Float, Int, Section
from dllm.config.model import ModelConfig
from dllm.config.registries import DRAFTERS

DrafterArchitecture = Literal["dllm", "dflash"]
"""The drafter architectures training builds (dflash2 drafters are loaded from the public layout only)."""


class DynamicConvConfig(Section):
    """DFlash2's grouped dynamic causal convolutions around each block's attention and MLP (public keys
    conv_kernel_size, conv_group_size)."""

    kernel_size: Int = Field(gt=0)
    """Taps: a row mixes itself and the kernel_size - 1 rows before it in its draft block."""
    group_size: Int = Field(gt=0)
    """Channels per group: the dynamic part of the kernel is one weight per group, tap and row."""


class SelectorConfig(Section):
    """DFlash2's candidate selector (public keys selector_rank, selector_top_k): the draft is a chain
    through each position's top-k tokens, scored by the logits plus a low-rank predecessor/successor term."""

    rank: Int = Field(gt=0)
    """Width of the token codebooks and of the projected draft states."""
    top_k: Int = Field(gt=0)
    """Candidates per position (the tokens of highest draft logit)."""


class DFlashConfig(Section):
    """A DFlash drafter (Chen et al. 2025): a few bidirectional blocks that read the target's hidden states."""

    num_layers: Int = Field(default=1, gt=0)
    """Drafter blocks (each attends to the projected target context plus its own draft block)."""
    block_size: Int = Field(default=8, ge=2)
    """b: a draft block is [last accepted token, MASK x (b-1)]; one forward proposes b - 1 tokens."""
    target_layer_ids: tuple[Int, ...] = Field(min_length=1)
    """Target blocks (0-based into its layers) whose outputs are concatenated as the drafter's context features."""
    mask_id: Int = Field(ge=0)
    """Token id of the MASK placeholders of a draft block (embedded with the target's embedding)."""
    target: ModelConfig
    """The target's architecture: the drafter's blocks copy its widths, heads, norms and RoPE (never its weights)."""
    architecture: Literal["dllm", "dflash", "dflash2"] = "dllm"
    """dflash: the published drafter (Qwen3 blocks, raw fused context); dflash2: dflash with `conv` and `selector`;
    dllm: target-layout blocks, context normed."""
    blocks: ModelConfig | None = None
    """The blocks' own architecture (a public drafter folder's widths, heads and RoPE); null: from the target."""
    conv: DynamicConvConfig | None = None
    """dflash2: the convolutions around each block's attention and MLP; null for the other architectures."""
    selector: SelectorConfig | None = None
    """dflash2: the candidate selector that picks the drafted tokens; null for the other architectures."""
    input_embedding_scale: Float = 1.0
    """Factor on the embedded draft block (public key input_embedding_scale)."""
    output_multiplier: Float = 1.0
    """Factor on the draft logits (public key output_multiplier)."""
    final_logit_softcapping: Float | None = Field(default=None, gt=0)
    """Draft logits through c * tanh(logits / c) (public key final_logit_softcapping); null: none."""
    layer_types: tuple[Literal["full_attention", "sliding_attention"], ...] | None = None
    """Per block (public key layer_types): sliding_attention sees keys fewer than sliding_window positions away
    and is causal unless `causal` is false; null: all full_attention."""
    sliding_window: Int | None = Field(default=None, gt=0)
    """The window of the sliding_attention blocks (public key sliding_window)."""
    causal: bool | None = None
    """Public key is_causal: true makes every block causal inside its draft block, false none; null: the
    sliding_attention blocks only."""

    @model_validator(mode="after")
    def _check_target(self) -> DFlashConfig:
        n = self.target.num_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < n]
        if bad:
            raise ValueError(f"target_layer_ids {bad} are outside the target's {n} layers (0-based)")
        if self.target.vocab_size is not None and self.mask_id >= self.target.vocab_size:
            raise ValueError(f"mask_id {self.mask_id} is outside the target's vocabulary of {self.target.vocab_size}")
        if self.target.rope_yarn is not None or self.target.query_scale_beta is not None:
            raise ValueError("a target with YaRN RoPE or a query temperature (Ministral 3) has no drafter here yet")
        if self.blocks is not None and self.blocks.hidden_size != self.target.hidden_size:
            raise ValueError(f"the drafter's hidden size {self.blocks.hidden_size} is not the target's "
                             f"{self.target.hidden_size}")  # fmt: skip
        if self.architecture != "dllm":
            self._check_public()
        elif (self.input_embedding_scale, self.output_multiplier, self.final_logit_softcapping, self.layer_types,
              bool(self.causal)) != (1.0, 1.0, None, None, False):  # fmt: skip
            raise ValueError("architecture dllm: input_embedding_scale, output_multiplier, final_logit_softcapping, "
                             "layer_types and causal are public drafter settings; leave them unset")  # fmt: skip
        self._check_dflash2()
        self._check_layer_types()
        return self

    def _check_layer_types(self) -> None:
        types = self.layer_types
        if types is not None and len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} drafter blocks")
        if types is not None and "sliding_attention" in types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention blocks but sliding_window is not set")

    def layer_kind(self, index: int) -> tuple[bool, int | None]:
        """(causal inside the draft block, sliding window or None) of drafter block `index`, as the public code
        reads layer_types and is_causal."""
        sliding = self.layer_types is not None and self.layer_types[index] == "sliding_attention"
        return (sliding if self.causal is None else self.causal), (self.sliding_window if sliding else None)

    def _check_dflash2(self) -> None:
        """conv and selector: both set for dflash2 (the public DFlash2DraftModel builds both), neither otherwise."""
        dflash2 = self.architecture == "dflash2"
        if dflash2 != (self.conv is not None) or dflash2 != (self.selector is not None):
            raise ValueError(f"architecture {self.architecture}: conv and selector are "
                             f"{'required' if dflash2 else 'DFlash2 parts; use architecture dflash2'}")  # fmt: skip
        E = self.hidden_size
        if self.conv is not None and E % self.conv.group_size:
            raise ValueError(f"conv.group_size {self.conv.group_size} does not divide the hidden size {E}")
        V = self.target.vocab_size
        if self.selector is not None and V is not None and self.selector.top_k > V:
            raise ValueError(f"selector.top_k {self.selector.top_k} is more than the vocabulary of {V} tokens")

    def _check_public(self) -> None:
        """What the published drafter reads of its target: hidden states after a block (Hugging Face's
        hidden_states[i + 1], whose last entry is taken after the target's final norm) and its bare token
        embedding (the dflash package, SGLang and vLLM embed a block with the embedding matrix alone)."""
        t, arch = self.target, self.architecture
        if t.num_layers - 1 in self.target_layer_ids and t.final_norm:
            raise ValueError(
                f"architecture {arch}: target_layer_ids include the target's last layer {t.num_layers - 1}, which the "
                "public DFlash code reads after the target's final norm and dllm before it; read layers before the last"
            )
        if t.position != "rope" or t.embedding_norm or t.self_condition or t.head != "linear":
            raise ValueError(
                f"architecture {arch}: the {t.family} target adds positions or a norm to its token embedding (or has "
                "no linear head), which the public drafters do not; use architecture dllm"
            )
        c = self.blocks
        if c is not None and not (
            c.norm == "rmsnorm" and c.norm_position == "pre" and c.mlp == "gated" and c.position == "rope"
            and c.qk_norm and c.qk_norm_width == "head" and c.qkv_bias == c.attn_out_bias and not c.mlp_bias
            and not c.num_experts and c.attention_pattern is None
        ):  # fmt: skip
            raise ValueError(f"architecture {arch}: the blocks are not Qwen3 decoder layers (RMSNorm, per-head q/k "
                             "norms, a gated MLP, RoPE, one bias setting for q, k, v and o)")  # fmt: skip

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        """F: the width of the concatenated target features."""
        return len(self.target_layer_ids) * self.target.hidden_size

    @property
    def block_config(self) -> ModelConfig:
        """The architecture of the drafter's blocks: `blocks` if given, else the target's layout (dllm) or
        Qwen3 blocks of the target's widths, heads and RoPE (dflash, dflash2)."""
        update = {"num_layers": self.num_layers, "init_from": None}
        if self.blocks is not None:
            return self.blocks.model_copy(update=update)
        t = self.target
        if self.architecture == "dllm":
            return t.model_copy(update=update)
        return ModelConfig(
            family="qwen3", vocab_size=t.vocab_size, hidden_size=t.hidden_size, num_layers=self.num_layers,
            num_heads=t.num_heads, num_kv_heads=t.kv_heads, head_dim=t.dim_per_head, intermediate_size=t.mlp_size,
            max_seq_len=t.max_seq_len, rope_theta=t.rope_theta, norm_eps=t.norm_eps, init_std=t.init_std,
            attention_backend=t.attention_backend, flex_compile=t.flex_compile,
        )  # fmt: skip


class DrafterKind(Section):
    """The family of a drafter folder: its config.json `model_type`, which picks the loader (DRAFTERS)."""

    model_type: Literal[DRAFTERS.names()]  # type: ignore[valid-type]
    """Drafter family: dflash (DFlash block-diffusion drafters, Chen et al. 2025)."""
