"""SamplerConfig: how masks turn into text (`dllm generate`, `dllm chat`, evaluation, serving)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationError, model_validator

from dllm.config.base import Float, Int, Section, Seed
from dllm.config.profile import DecodeProfile
from dllm.config.registries import CACHES, POLICIES
from dllm.errors import ConfigError

MAX_STEPS = 1 << 20
"""The largest step budget (a forward each): more is no schedule, and sizes a tensor past what torch can index."""
DENOISE_STEPS = 48
"""canvas_denoise: steps per canvas when `steps` is unset (the reference generation mixin's max_denoising_steps)."""
DENOISE_FIELDS = ("denoise_entropy_bound", "denoise_t_min", "denoise_t_max", "denoise_stability_threshold",
                  "denoise_confidence_threshold", "denoise_cache")  # fmt: skip
"""The fields of canvas_denoise alone."""
SHARED_FIELDS = ("gen_length", "temperature", "stop_at_eos", "stop_strings", "seed", "generation")
"""What every generation mode reads: the length, the temperature, the ends, the seed."""
CANVAS_FIELDS = ("block_length", "steps", "policy", "threshold", "edit_threshold", "max_post_steps", "min_commit",
                 "factor", "top_k", "top_p", "cfg_scale", "cache", "refresh_every", "attention", "sub_block_length",
                 "causal_context", "shift", "reuse_unchanged", "compile")  # fmt: skip
READS: dict[str, frozenset[str]] = {
    "canvas": frozenset((*SHARED_FIELDS, *CANVAS_FIELDS)),
    "causal": frozenset((*SHARED_FIELDS, "top_k", "top_p")),
    "edit_flow": frozenset((*SHARED_FIELDS, "steps", "edit_kappa", "edit_end_time", "compile")),
    "canvas_denoise": frozenset((*SHARED_FIELDS, "steps", "block_length", "compile", *DENOISE_FIELDS)),
}
"""The fields each generation mode reads (the others are refused by `resolve_sampler` when set to other than their
default, the same way everywhere: one line on the command line, a 400 naming the field on the server)."""
HOW = {
    "canvas": "canvas decoding (mask policies and caches)",
    "causal": "causal decoding (AR, or speculative with a drafter: one token per position, no steps, no canvas)",
    "edit_flow": "edit_flow decoding (tau-leaping over edit rates: no mask policy, cache, guidance or blocks)",
    "canvas_denoise": "canvas_denoise, DiffusionGemma's canvas sampler (random canvases, no mask policy)",
}


class SamplerConfig(Section):
    """How `dllm generate` / `dllm chat` turn masks into text: one loop for every policy and cache.

    Scheduled policies (low_confidence, random, margin, entropy) commit an even share of a block per
    step; threshold and factor commit as many as they trust (Fast-dLLM); a block that still has masks
    after its budget keeps going, counted as overrun, so no output ever holds a mask. Block models
    (attention: block) decode block-causally with their training block size, blocks aligned to
    positions from each prompt's start; `auto` fields are filled from the run (config.rules.resolve_sampler).
    Edit Flows models decode by tau-leaping (edit_*), DiffusionGemma models (attention prefix_canvas) by their
    canvas sampler (generation canvas_denoise, denoise_*), both chosen by the model's decode profile.
    """

    gen_length: Int = Field(default=32, gt=0)
    """Tokens to generate after the prompt (max_new_tokens); canvas_denoise: rounded up to whole canvases."""
    block_length: Int | None = Field(default=None, gt=0)
    """Semi-autoregressive block (canvas_denoise: the canvas); divides gen_length. null: gen_length / run's block."""
    steps: Int | None = Field(default=None, gt=0, le=MAX_STEPS)
    """Step budget over all blocks, a multiple of the number of blocks; null: gen_length (canvas_denoise: 48/canvas)."""
    policy: Literal[POLICIES.names()] = "low_confidence"  # type: ignore[valid-type]
    """low_confidence, random, margin, entropy, threshold, factor, ancestral, first_hitting, uniform, llada2[_edit]."""
    threshold: Float = Field(default=0.9, gt=0, le=1)
    """policy threshold: commit every masked position whose proposal has at least this probability (at least one)."""
    edit_threshold: Float = Field(default=0.9, gt=0, le=1)
    """policy llada2_edit: rewrite a decided token of the block when the model proposes another with p above this."""
    max_post_steps: Int = Field(default=16, ge=0, le=MAX_STEPS)
    """policy llada2_edit: steps a block may take after its last mask is filled, while they still edit tokens."""
    min_commit: Int = Field(default=1, gt=0)
    """policy llada2_edit: masks committed per step (the most confident) when fewer pass the threshold."""
    factor: Float = Field(default=1.0, gt=0)
    """policy factor: commit the n most confident positions with (n + 1) * (1 - p_n) < factor (at least one)."""
    temperature: Float = Field(default=0.0, ge=0)
    """0 is greedy; above 0 samples with Gumbel noise in float64 (canvas_denoise: 1 samples at denoise_t_min..t_max)."""
    top_k: Int | None = Field(default=None, gt=0)
    """Sample only among the k most probable tokens (with temperature > 0); null keeps all."""
    top_p: Float | None = Field(default=None, gt=0, le=1)
    """Nucleus sampling: the smallest set of tokens with this total probability (temperature > 0); null keeps all."""
    cfg_scale: Float = Field(default=0.0, ge=0)
    """Classifier-free guidance w: uncond + (1 + w) * (cond - uncond), prompt masked in the uncond pass; 0 is off."""
    cache: Literal[CACHES.names()] = "none"  # type: ignore[valid-type]
    """KV cache: prefix or dual (approximate, bidirectional models), block (exact, block models), or none."""
    refresh_every: Int | None = Field(default=None, gt=0)
    """prefix / dual: also refresh the cache with a full forward every N steps in a block; null: block starts only."""
    attention: Literal["auto", "bidirectional", "block"] = "auto"
    """bidirectional (MDLM, LLaDA, Dream) or block-causal (BD3LM, Fast-dLLM v2); auto: from the run's objective."""
    sub_block_length: Int | None = Field(default=None, gt=0)
    """Block models: decode each block in sub-blocks of this length, left to right (Fast-dLLM v2); null: whole block."""
    causal_context: Literal["auto", "on", "off"] = "auto"
    """Block attention: read the prompt and committed blocks causally (Nemotron-Labs-Diffusion); auto: the run's."""
    shift: Literal["auto", "on", "off"] = "auto"
    """Predict position i from the hidden state at i-1 (Dream, Fast-dLLM v2); auto: from the model and the objective."""
    reuse_unchanged: bool = True
    """ancestral: a step that changes no token reuses the previous forward's logits (exact: the same input)."""
    stop_at_eos: bool = True
    """Cut each output at its first EOS and stop early once every row has one."""
    stop_strings: list[str] = Field(default_factory=list)
    """Cut each output at the first of these strings, and stop early once every row has one."""
    seed: Seed = 0
    """Seed of the sampling noise (temperature, random orders and the process policies)."""
    generation: Literal["auto", "canvas", "edit_flow", "causal", "canvas_denoise"] = "auto"
    """canvas (mask policies), edit_flow, causal (AR; --draft), canvas_denoise (DiffusionGemma); auto: by profile."""
    edit_kappa: Literal["auto", "cubic", "linear"] = "auto"
    """edit_flow: the schedule whose weight tau-leaping integrates; auto: the run's objective.kappa."""
    edit_end_time: Float | None = Field(default=None, gt=0, le=1)
    """edit_flow: the time tau-leaping ends at (1 fires every intensity left); null: 1 - the run's objective.eps."""
    denoise_entropy_bound: Float = Field(default=0.1, gt=0)
    """canvas_denoise: accept the lowest-entropy proposals whose entropies, less the largest, sum to at most this."""
    denoise_t_min: Float = Field(default=0.4, ge=0)
    """canvas_denoise: temperature of a canvas's last step (t = t_min + (t_max - t_min) * steps left / steps)."""
    denoise_t_max: Float = Field(default=0.8, ge=0)
    """canvas_denoise: temperature of a canvas's first step; above denoise_t_min."""
    denoise_stability_threshold: Int = Field(default=1, ge=0)
    """canvas_denoise: a canvas stops once its argmax was unchanged for this many steps (and it is confident)."""
    denoise_confidence_threshold: Float = Field(default=0.005, gt=0)
    """canvas_denoise: a canvas stops only once the mean entropy of its tempered logits is also below this."""
    denoise_cache: bool = True
    """canvas_denoise: keep the clean rows' keys and values across steps and canvases (exact: they never see one)."""
    compile: bool = False
    """Compile each transformer block in place with torch.compile (dynamic shapes: a new prompt length reuses it)."""

    @property
    def block(self) -> int:
        """The block length in effect (gen_length when unset)."""
        return self.block_length or self.gen_length

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block

    @property
    def total_steps(self) -> int:
        """The step budget in effect (gen_length when unset; canvas_denoise: DENOISE_STEPS per canvas)."""
        if self.steps is None and self.generation == "canvas_denoise":
            return DENOISE_STEPS * self.num_blocks
        return self.steps or self.gen_length

    @model_validator(mode="after")
    def _check_blocks(self) -> SamplerConfig:
        if self.gen_length % self.block:
            raise ValueError(f"block_length {self.block} must divide gen_length {self.gen_length}")
        num_blocks = self.num_blocks
        if self.total_steps % num_blocks:
            raise ValueError(f"steps {self.total_steps} must be a multiple of the number of blocks ({num_blocks})")
        if self.sub_block_length is not None:
            if self.block % self.sub_block_length:
                raise ValueError(f"sub_block_length {self.sub_block_length} must divide block_length {self.block}")
            subs = self.block // self.sub_block_length
            if POLICIES.has(self.policy, "scheduled") and (self.total_steps // num_blocks) % subs:
                raise ValueError(f"steps per block ({self.total_steps // num_blocks}) must be a multiple of the "
                                 f"{subs} sub-blocks of a block")  # fmt: skip
        if POLICIES.has(self.policy, "process") and (self.cache != "none" or self.sub_block_length is not None):
            raise ValueError(f"policy {self.policy} runs its own reverse process: use cache none, no sub-blocks")
        if self.cfg_scale > 0 and self.cache != "none":
            raise ValueError("cfg_scale > 0 runs a masked-prompt pass beside each forward: use cache none")
        if self.refresh_every is not None and not CACHES.has(self.cache, "approximate"):
            raise ValueError(f"refresh_every applies to the prefix and dual caches, not cache {self.cache}")
        if self.attention == "bidirectional" and self.causal_context == "on":
            raise ValueError("causal_context reads the context of block attention; set attention: block")
        if self.attention == "bidirectional" and (CACHES.has(self.cache, "block") or self.sub_block_length is not None):
            raise ValueError("cache block and sub_block_length need block attention (a block-diffusion model)")
        if self.attention == "block" and CACHES.has(self.cache, "approximate"):
            raise ValueError(f"block models decode with the exact cache: use cache block, not {self.cache}")
        if POLICIES.has(self.policy, "block") and (self.attention == "bidirectional" or self.sub_block_length):
            raise ValueError(f"policy {self.policy} decodes whole blocks of a block-causal model (LLaDA2): use "
                             "attention block and no sub_block_length")  # fmt: skip
        if self.attention == "block" and self.policy in ("ancestral", "first_hitting", "uniform"):
            raise ValueError(f"policy {self.policy} decodes bidirectional models; use attention bidirectional")
        if self.denoise_t_max <= self.denoise_t_min:
            raise ValueError(f"denoise_t_max {self.denoise_t_max} must be above denoise_t_min {self.denoise_t_min}")
        return self


def resolve_sampler(cfg: SamplerConfig, profile: DecodeProfile) -> SamplerConfig:
    """Fill `attention`, `shift`, the block and sub-block lengths from the model's decode profile, pick the
    loop (`generation`; canvas_denoise for a DiffusionGemma profile, `_resolve_denoise`; causal for a causal
    profile, an ar run, when no loop is asked for), and refuse a
    sampler the model was not trained for. Causal decoding reads only the length, temperature,
    top-k/p, EOS and stop fields as they are (whether the model is causal is the loader's to say:
    `models.families.base.is_causal_model` also knows the model family)."""
    if profile.attention == "prefix_canvas" and cfg.generation != "causal":
        return _resolve_denoise(cfg, profile)
    if profile.attention == "causal" and cfg.generation == "auto":  # an ar run decodes causally unasked
        cfg = cfg.model_copy(update={"generation": "causal"})
    if cfg.generation == "causal":
        refuse_unread(cfg, "causal")
        _check_length(cfg, profile)
        return cfg
    if profile.attention == "causal":
        raise ConfigError(
            f"sampler.generation: {cfg.generation} cannot decode this model: it is autoregressive (trained with "
            f"{profile.objective or 'a causal objective'}: attention causal in its decode profile); use generation auto"
        )
    trained = f"this run was trained with {profile.objective}" if profile.objective else "this model decodes masks"
    if profile.corruption == "uniform" and cfg.policy != "uniform":
        raise ConfigError(
            f"sampler.policy: {cfg.policy} decodes mask tokens, but this run was trained with the uniform "
            "objective (no mask token); use policy uniform"
        )
    if profile.corruption != "uniform" and cfg.policy == "uniform":
        raise ConfigError(f"sampler.policy: uniform decodes uniform-state models; {trained}")
    generation = _check_generation(cfg, profile, trained)
    refuse_unread(cfg, generation)
    _check_length(cfg, profile)
    attention = cfg.attention if cfg.attention != "auto" else profile.attention
    shift = cfg.shift if cfg.shift != "auto" else ("on" if profile.shift else "off")
    causal_context = cfg.causal_context
    if causal_context == "auto":
        causal_context = "on" if attention == "block" and profile.causal_context else "off"
    values = {**cfg.model_dump(), "attention": attention, "shift": shift, "generation": generation,
              "causal_context": causal_context}  # fmt: skip
    if generation == "edit_flow":  # its loop reads no attention, shift or context: they stay unset, re-resolvable
        values.update(attention=cfg.attention, shift=cfg.shift, causal_context=cfg.causal_context)
        if cfg.edit_kappa == "auto":
            values["edit_kappa"] = profile.edit_kappa or "cubic"
        if cfg.edit_end_time is None:
            values["edit_end_time"] = 1.0 - (profile.edit_eps or 1e-3)
    if attention == "block" and profile.block_size is not None:
        # a causal context reads the same keys for any block length, so a shorter one is in distribution (the
        # published Nemotron-Labs-Diffusion sampler decodes its 64-token training blocks in blocks of 32)
        shorter_ok = causal_context == "on" and cfg.block_length is not None and cfg.block_length < profile.block_size
        if cfg.block_length is not None and cfg.block_length != profile.block_size and not shorter_ok:
            raise ConfigError(
                f"sampler.block_length: this run was trained with blocks of {profile.block_size}; "
                "block-causal sampling must use the same block length (a causal-context run: the same or shorter)"
            )
        values["block_length"] = cfg.block_length if cfg.block_length is not None else profile.block_size
        if cfg.sub_block_length is None:
            values["sub_block_length"] = profile.sub_block_size
    if attention == "block" and values["block_length"] is None:
        raise ConfigError("sampler.block_length: block attention needs the model's block length; set it")
    try:
        return SamplerConfig.model_validate(values)
    except ValidationError as e:  # a combination that only became invalid once auto was resolved
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"sampler: {msg} (attention resolved to {attention} from the run)") from None


def _check_length(cfg: SamplerConfig, profile: DecodeProfile) -> None:
    if cfg.gen_length > profile.max_length:
        raise ConfigError(
            f"sampler.gen_length: {cfg.gen_length} exceeds the {profile.max_length} positions the model covers "
            "(prompt + generation); lower it"
        )


def _check_generation(cfg: SamplerConfig, profile: DecodeProfile, trained: str) -> str:
    """canvas or edit_flow, from the profile; a sampler of the other kind is refused."""
    if cfg.generation == "canvas_denoise":
        raise ConfigError(f"sampler.generation: canvas_denoise decodes DiffusionGemma models (attention prefix_canvas "
                          f"in the decode profile); {trained}; use generation auto")  # fmt: skip
    if cfg.generation not in ("auto", profile.generation):
        if cfg.generation == "edit_flow":
            raise ConfigError(f"sampler.generation: edit_flow (tau-leaping) needs an Edit Flows model; {trained}")
        raise ConfigError(
            f"sampler.generation: {cfg.generation} commits mask positions, but {trained} (edit rates, no mask "
            "canvas); use generation edit_flow or auto"
        )
    if profile.generation != "edit_flow":
        return profile.generation
    chosen = "policy" in cfg.model_fields_set and cfg.generation == "auto"
    if chosen or cfg.policy != SamplerConfig.model_fields["policy"].default:
        raise ConfigError(
            f"sampler.policy: {cfg.policy} commits mask positions, but {trained} (edit rates, decoded by "
            "tau-leaping); leave the policy out"
        )
    if cfg.cache != "none" or cfg.cfg_scale > 0 or cfg.block_length is not None:
        raise ConfigError("sampler: an edit-flow run decodes without cache, guidance or blocks; "
                          "use cache none, cfg_scale 0, no block_length")  # fmt: skip
    return "edit_flow"


def _resolve_denoise(cfg: SamplerConfig, profile: DecodeProfile) -> SamplerConfig:
    """canvas_denoise, for a model that decodes canvases after a causally encoded prefix (DiffusionGemma):
    canvases of the profile's block size, gen_length rounded up to whole canvases; a field of the other
    loops set to other than its default is refused (it would do nothing)."""
    what = "canvas_denoise, DiffusionGemma's canvas sampler (attention prefix_canvas in the model's decode profile)"
    if cfg.generation not in ("auto", "canvas_denoise"):
        raise ConfigError(f"sampler.generation: {cfg.generation} cannot decode this model, which decodes with {what}; "
                          "use generation auto")  # fmt: skip
    refuse_unread(cfg, "canvas_denoise")
    if cfg.temperature not in (0.0, 1.0):
        raise ConfigError(
            f"sampler.temperature: {cfg.temperature}: canvas_denoise proposes each position's argmax (0) or samples "
            "at its schedule's temperature (1); set denoise_t_min / denoise_t_max to change the schedule"
        )
    canvas = profile.block_size
    assert canvas is not None, "a prefix_canvas profile has a block size (DecodeProfile checks it)"
    if cfg.block_length is not None and cfg.block_length != canvas:
        raise ConfigError(f"sampler.block_length: this model decodes canvases of {canvas} tokens (its decode "
                          f"profile's block_size); leave block_length out or set {canvas}")  # fmt: skip
    gen_length = -(-cfg.gen_length // canvas) * canvas  # whole canvases, as the reference decodes
    values = {**cfg.model_dump(), "generation": "canvas_denoise", "block_length": canvas, "gen_length": gen_length}
    try:
        resolved = SamplerConfig.model_validate(values)
    except ValidationError as e:  # steps that do not split evenly over the canvases
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ConfigError(f"sampler: {msg} (canvas_denoise: {gen_length // canvas} canvas(es) of {canvas})") from None
    _check_length(resolved, profile)
    return resolved


def unread_fields(cfg: SamplerConfig, generation: str) -> list[str]:
    """The fields `generation`'s loop does not read that `cfg` sets to other than their defaults."""
    fields = SamplerConfig.model_fields.items()
    return [
        name
        for name, info in fields
        if name not in READS[generation] and getattr(cfg, name) != info.get_default(call_default_factory=True)
    ]


def refuse_unread(cfg: SamplerConfig, generation: str) -> None:
    """A field `generation`'s loop does not read, set to other than its default: one line naming it (it would do
    nothing)."""
    unread = unread_fields(cfg, generation)
    if unread:
        raise ConfigError(f"sampler.{unread[0]}: no effect on {HOW[generation]}; leave it out")
