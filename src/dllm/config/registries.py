"""Every extension point of dllm, one registry per kind: the only place a name picks an implementation.

The config sections take their allowed values from here (`Literal[OBJECTIVES.names()]`), so a YAML
typo is rejected with the list of known names before anything is built, and the assembly step
(training/build.py, checkpoint/loading.py, the sampling setup) resolves each name once. Adding an
implementation (an objective, schedule, sampling policy or cache, source, record format, artifact
layout, tokenizer, attention backend, family, norm, activation, learning-rate schedule) is its own
file or function plus one line here; an objective or a source also brings its config section (its
own fields), whose `name`/`kind` tag must be the registered name. tests/contracts/test_registries.py
checks that the config accepts exactly the registered names and that every entry resolves, inside
the part its registry declares; tests/test_architecture.py holds each `resolve` to the layering.
Tags are facts the config needs before anything is imported.
"""

from __future__ import annotations

from dllm.registry import Registry, entry

# -- diffusion ----------------------------------------------------------------------------------------
OBJECTIVES = Registry(
    "objective",
    "diffusion",
    {
        "mdlm": "objectives.mdlm:MDLMObjective",
        "bd3lm": entry("objectives.block:BD3LMObjective", "block"),  # block: trains the block-diffusion layout
        "fast_dllm_v2": entry("objectives.block:FastDLLMv2Objective", "block"),
        # block: the 2L layout; x_0 token-causal and read by the next-token loss (Nemotron-Labs-Diffusion)
        "nemotron_diffusion": entry("objectives.nemotron:NemotronDiffusionObjective", "block"),
        "uniform": "objectives.uniform:UniformObjective",
        # DiffusionGemma's native SFT: [clean ; canvas of every response block] under the prefix_canvas mask;
        # frozen_routers: the build freezes the MoE routers (they keep their pretrained routing); prefix_canvas:
        # its model input is [clean ; canvas] (context parallelism's prefix_canvas shard layout)
        "diffusiongemma_native_sft": entry(
            "objectives.diffusion_gemma:DiffusionGemmaSFT", "frozen_routers", "prefix_canvas"
        ),
        "ar": entry("objectives.ar:ARObjective", "causal"),  # causal: next-token training, decoded with --ar
        "edit_flow": "objectives.edit_flow:EditFlowObjective",  # Edit Flows: insert/delete/substitute rates
        # target: trains a drafter of a frozen target model that training/build.py loads and hands over
        "dflash_distillation": entry("objectives.dflash:DFlashDistillation", "target"),
    },
)
SCHEDULES = Registry(
    "noise schedule",
    "diffusion",
    {"linear": "schedules:LinearSchedule", "cosine": "schedules:CosineSchedule"},
)

# -- sampling: scheduled policies commit a step-schedule count per step; process policies follow the
#    reverse process itself (no cache, no sub-blocks)
POLICIES = Registry(
    "sampling policy",
    "sampling",
    {
        "low_confidence": entry("policies:LowConfidence", "scheduled"),
        "random": entry("policies:RandomOrder", "scheduled"),
        "margin": entry("policies:Margin", "scheduled"),
        "entropy": entry("policies:Entropy", "scheduled"),
        "threshold": "policies:Threshold",
        "factor": "policies:Factor",
        "ancestral": entry("policies:Ancestral", "process"),
        "first_hitting": entry("policies:FirstHitting", "process"),
        "uniform": entry("policies:Uniform", "process"),
        "llada2": entry("policies:LLaDA2", "block"),  # block: block-causal models only, whole blocks
        "llada2_edit": entry("policies:LLaDA2Edit", "block"),
    },
)
CACHES = Registry(
    "sampling cache",
    "sampling",
    {
        "none": "cache:NoCache",
        "prefix": entry("cache:PrefixCache", "approximate"),  # approximate: bidirectional models, refreshable
        "dual": entry("cache:DualCache", "approximate"),
        "block": entry("cache:BlockCache", "block"),  # block: exact, needs block attention
    },
)

# -- data ---------------------------------------------------------------------------------------------
SOURCES = Registry(
    "source",
    "data",
    {
        "jsonl": "prepare.sources:read_jsonl",
        "parquet": "prepare.sources:read_parquet",
        "text": "prepare.sources:read_text",
        "hf_dataset": "prepare.sources:read_hf_dataset",
        "npy": "prepare.sources:read_npy",
    },
)
RECORD_FORMATS = Registry(
    "record format",
    "data",
    {
        "text": "prepare.render:render_text",
        "messages": "prepare.render:render_messages",
        "prompt_completion": "prepare.render:render_prompt_completion",
        "tokens": "prepare.render:render_tokens",
    },
)
LAYOUTS = Registry(
    "artifact layout",
    "data",
    {"packed": "prepare.packing:Packed", "indexed": "prepare.packing:Indexed"},
)
TOKENIZERS = Registry(
    "tokenizer",
    "tokenization",
    {"byte": "byte:ByteTokenizer.from_config", "hf": entry("hf:HFTokenizer.from_config", "path")},  # path: a folder
)

# -- models -------------------------------------------------------------------------------------------
ATTENTION_BACKENDS = Registry(
    "attention backend",
    "attention",
    {
        "auto": "backends.auto:auto_backend",
        "sdpa": "backends.sdpa:sdpa_backend",
        "flex": "backends.flex:flex_backend",
        "blockwise": "backends.blockwise:blockwise_backend",
    },
)
FAMILIES = Registry(
    "model family",
    "models",
    {
        "llama": "families.llama:LLAMA",
        "qwen2": "families.llama:QWEN2",
        "qwen3": "families.llama:QWEN3",
        "qwen3_moe": "families.llama:QWEN3_MOE",
        "llada": "families.llada:LLADA",
        "llada_moe": "families.llama:LLADA_MOE",
        "olmoe": "families.llama:OLMOE",
        "llada2_moe": "families.llada2:LLADA2_MOE",
        "dream": "families.llama:DREAM",
        "gpt2": "families.gpt2:GPT2",
        "bert": "families.encoders:BERT",
        "modernbert": "families.encoders:MODERNBERT",
        "qwen3_5": "families.qwen3_5:QWEN3_5",
        "qwen3_5_moe": "families.qwen3_5:QWEN3_5_MOE",
        "diffusion_gemma": "families.diffusion_gemma:DIFFUSION_GEMMA",
        "nemotron_labs_diffusion": "families.nemotron:NEMOTRON_LABS_DIFFUSION",
    },
)
NORMS = Registry(
    "norm",
    "models",
    {"rmsnorm": "layers:RMSNorm", "rmsnorm_centered": "layers:CenteredRMSNorm", "layernorm": "layers:LayerNorm"},
)
# a drafter folder's config.json `model_type` picks its loader `(folder, target) -> Drafter` (generate --draft)
DRAFTERS = Registry("drafter family", "models", {"dflash": "dflash_io:load_drafter"})
# public drafter layouts name their family by `architectures` (their model_type is their blocks', e.g. qwen3)
DRAFTER_ARCHITECTURES = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash"}
ACTIVATIONS = Registry(
    "activation",
    "models",
    {"silu": "layers:silu", "gelu": "layers:gelu", "gelu_tanh": "layers:gelu_tanh"},
)
# the chunked gated delta rule of the linear-attention layers: a factory `() -> rule` with the signature of
# models/gated_delta.py `chunked`; torch is that function (the reference), fla flash-linear-attention's kernel
DELTA_RULES = Registry("delta rule kernel", "models", {"torch": "gated_delta:torch_rule", "fla": "fla_rule:FlaRule"})

# -- training -----------------------------------------------------------------------------------------
LR_SCHEDULES = Registry(
    "learning-rate schedule",
    "training",
    {"cosine": "lr:cosine_decay", "linear": "lr:linear_decay", "constant": "lr:constant"},
)

# -- rl -------------------------------------------------------------------------------------------------
REWARDS = Registry(
    "reward",
    "rl",
    {
        "exact_answer": "rewards:ExactAnswer",
        "format": "rewards:FormatMatch",
        "length_penalty": "rewards:LengthPenalty",
    },
)

ALL: dict[str, Registry] = {
    "OBJECTIVES": OBJECTIVES,
    "SCHEDULES": SCHEDULES,
    "POLICIES": POLICIES,
    "CACHES": CACHES,
    "SOURCES": SOURCES,
    "RECORD_FORMATS": RECORD_FORMATS,
    "LAYOUTS": LAYOUTS,
    "TOKENIZERS": TOKENIZERS,
    "ATTENTION_BACKENDS": ATTENTION_BACKENDS,
    "FAMILIES": FAMILIES,
    "NORMS": NORMS,
    "ACTIVATIONS": ACTIVATIONS,
    "DELTA_RULES": DELTA_RULES,
    "DRAFTERS": DRAFTERS,
    "LR_SCHEDULES": LR_SCHEDULES,
    "REWARDS": REWARDS,
}
