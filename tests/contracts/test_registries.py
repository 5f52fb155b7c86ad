"""Contract tests for every registry and every registered implementation.

Registries: every one in dllm.config.registries.ALL. A new entry is covered here without writing a
test: names come from the registries, and the config must accept exactly the registered names.

Shapes: B batch, L sequence, V vocabulary, H query heads, K key/value heads, D head width.
"""

from __future__ import annotations

import importlib
import json
import math
import typing
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel

from dllm.attention.backends import make_attention
from dllm.attention.masks import AttentionMask
from dllm.config.data import TokenizerConfig
from dllm.config.drafter import DrafterKind
from dllm.config.model import ModelConfig
from dllm.config.objectives import (
    ARConfig,
    BD3LMConfig,
    FastDLLMv2Config,
    MDLMConfig,
    NemotronDiffusionConfig,
    ObjectiveConfig,
    UniformConfig,
)
from dllm.config.prepare import PrepareSpec
from dllm.config.profile import DecodeProfile
from dllm.config.registries import (
    ALL,
    ATTENTION_BACKENDS,
    FAMILIES,
    OBJECTIVES,
    POLICIES,
    SCHEDULES,
    SOURCES,
    TOKENIZERS,
)
from dllm.config.rl import RewardConfig
from dllm.config.sampler import SamplerConfig
from dllm.config.training import SchedulerConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import LossOutput, ModelInputs, TokenIds
from dllm.models import Transformer
from dllm.registry import Registry, entry
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.policies import Parallel, Proposal, Scheduled, StepState, make_policy, select_topk
from dllm.sampling.proposals import commit_schedule
from tests.helpers import output_of_logits

REGISTRIES: dict[str, Registry] = ALL


def literal_names(model_cls, field: str) -> set[str]:
    """The strings a pydantic field's Literal annotation accepts (through Optional/list/Union)."""

    def walk(tp) -> set[str]:
        if typing.get_origin(tp) is typing.Literal:
            return {a for a in typing.get_args(tp) if isinstance(a, str)}
        out: set[str] = set()
        for arg in typing.get_args(tp):
            out |= walk(arg)
        return out

    return walk(model_cls.model_fields[field].annotation)


def union_literals(annotation, field: str) -> set[str]:
    """The strings a field accepts across the members of a tagged union of config classes."""
    out: set[str] = set()
    for member in typing.get_args(typing.get_args(annotation)[0]):
        if field in member.model_fields:
            out |= literal_names(member, field)
    return out


def source_sections() -> list[type[BaseModel]]:
    """Every source section class prepare.yaml accepts (through list/Union/Annotated)."""

    def walk(tp) -> list[type[BaseModel]]:
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            return [tp] if "kind" in tp.model_fields else []
        return [cls for arg in typing.get_args(tp) for cls in walk(arg)]

    return walk(PrepareSpec.model_fields["sources"].annotation)


def source_field(field: str) -> set[str]:
    return {n for cls in source_sections() if field in cls.model_fields for n in literal_names(cls, field)}


OBJECTIVE_SECTIONS = typing.get_args(typing.get_args(ObjectiveConfig)[0])
CONFIG_SECTIONS = {cls.model_fields["name"].default: cls for cls in OBJECTIVE_SECTIONS}
"""objective name -> its config section (an objective brings its own fields)."""

CONFIG_LITERALS = {  # registry -> names its config accepts
    "FAMILIES": lambda: literal_names(ModelConfig, "family"),
    "NORMS": lambda: literal_names(ModelConfig, "norm"),
    "ACTIVATIONS": lambda: literal_names(ModelConfig, "activation"),
    "ATTENTION_BACKENDS": lambda: literal_names(ModelConfig, "attention_backend"),
    "DELTA_RULES": lambda: literal_names(ModelConfig, "linear_attention_kernel"),
    "OBJECTIVES": lambda: union_literals(ObjectiveConfig, "name"),
    "SCHEDULES": lambda: union_literals(ObjectiveConfig, "schedule") | literal_names(DecodeProfile, "schedule"),
    "POLICIES": lambda: literal_names(SamplerConfig, "policy"),
    "CACHES": lambda: literal_names(SamplerConfig, "cache"),
    "SOURCES": lambda: source_field("kind"),
    "RECORD_FORMATS": lambda: source_field("format"),
    "LAYOUTS": lambda: literal_names(PrepareSpec, "layout"),
    "TOKENIZERS": lambda: literal_names(TokenizerConfig, "kind"),
    "LR_SCHEDULES": lambda: literal_names(SchedulerConfig, "name"),
    "REWARDS": lambda: literal_names(RewardConfig, "name"),  # besides the registered names: user module:function
    "DRAFTERS": lambda: literal_names(DrafterKind, "model_type"),
}


# --------------------------------------------------------------------------------------------------
# the Registry class and every registry instance


def test_registry_class_behaviour():
    reg: Registry = Registry("widget", "registry_fixture", {"b": "x:B", "a": entry("x:A.make", "odd")})
    assert reg.names() == ("b", "a") and list(reg) == ["b", "a"] and len(reg) == 2  # declaration order
    assert reg.names("odd") == ("a",) and reg.has("a", "odd") and not reg.has("b", "odd") and not reg.has("c", "odd")
    assert "a" in reg and "c" not in reg
    assert reg.module_of("a") == "dllm.registry_fixture.x"
    with pytest.raises(KeyError, match=r"unknown widget 'zzz'; known: b, a"):
        reg.resolve("zzz")
    with pytest.raises(AssertionError, match="not 'module:object'"):
        Registry("widget", "part", {"a": "no_colon"})


def test_registry_resolves_lazily_and_once(monkeypatch):
    """Nothing is imported until a name is resolved; a dotted attribute (a classmethod) is followed."""
    reg: Registry = Registry("tokenizer", "tokenization", {"byte": "byte:ByteTokenizer.from_config"})
    imported: list[str] = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or real(name))
    assert imported == []
    first = reg.resolve("byte")
    assert reg.resolve("byte") is first and imported == ["dllm.tokenization.byte"]
    assert first.__self__.__name__ == "ByteTokenizer"


@pytest.mark.parametrize("reg_name", sorted(REGISTRIES))
def test_every_entry_resolves_inside_its_part(reg_name):
    """Each target imports, exists, is callable, and lives in the part the registry declares (the layering
    of ARCHITECTURE.toml applies to the string targets too)."""
    reg = REGISTRIES[reg_name]
    assert len(reg) > 0, f"{reg_name} is empty"
    for name in reg:
        assert reg.module_of(name).startswith(f"dllm.{reg.part}."), (reg_name, name)
        obj = reg.resolve(name)
        assert obj is not None, f"{reg_name} {name!r} resolves to None"
        assert callable(obj) or reg_name == "FAMILIES", f"{reg_name} {name!r}: {obj!r} is not callable"


def test_families_resolve_to_their_own_family():
    for name in REGISTRIES["FAMILIES"]:
        assert REGISTRIES["FAMILIES"].resolve(name).name == name


@pytest.mark.parametrize("reg_name", sorted(REGISTRIES))
def test_registry_unknown_name_lists_known(reg_name):
    reg = REGISTRIES[reg_name]
    with pytest.raises(KeyError) as info:
        reg.resolve("no-such-name")
    for name in reg.names():
        assert name in str(info.value)


def test_every_registry_has_its_config_field():
    assert set(CONFIG_LITERALS) == set(REGISTRIES)


@pytest.mark.parametrize("reg_name", sorted(CONFIG_LITERALS))
def test_config_accepts_exactly_the_registered_names(reg_name):
    """Strings stop at the YAML boundary: the config accepts every registered name and nothing else."""
    accepted = CONFIG_LITERALS[reg_name]()
    registered = set(REGISTRIES[reg_name].names())
    assert accepted == registered, f"{reg_name}: config accepts {sorted(accepted)}, registered {sorted(registered)}"


def test_tags_agree_with_the_implementations():
    """The facts the config reads from tags before importing anything match the implementations."""
    for name in OBJECTIVES:
        facts = CONFIG_SECTIONS[name].model_construct().decode_facts()  # defaults; required paths unset
        assert (facts["attention"] == "block") == OBJECTIVES.has(name, "block"), name
        assert (facts["attention"] == "causal") == OBJECTIVES.has(name, "causal"), name
    for name in POLICIES:
        policy = POLICIES.resolve(name)
        assert POLICIES.has(name, "scheduled") == policy.scheduled, name
        process = not issubclass(policy, (Scheduled, Parallel))  # simulates the reverse process itself
        assert POLICIES.has(name, "process") == process, name
        assert POLICIES.has(name, "block") == policy.block_only, name
    for name in TOKENIZERS:
        assert TOKENIZERS.has(name, "path") == (name != "byte")


# --------------------------------------------------------------------------------------------------
# models

V = 48
MASK_ID = V - 1


def tiny_model(family: str, seed: int = 0):
    cfg = ModelConfig(preset="tiny", family=family, vocab_size=V, num_layers=1)
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


@pytest.mark.parametrize("family", FAMILIES.names())
def test_model_contract(family):
    model = tiny_model(family)
    tokens = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).expand(2, 6)
    mask = AttentionMask("causal" if model.cfg.has_linear_layers else "bidirectional")  # recurrences are causal
    out = model(tokens, positions, mask).logits()
    assert out.shape == (2, 6, V) and bool(torch.isfinite(out).all())
    # same seed, same weights
    other = tiny_model(family)
    torch.testing.assert_close(other(tokens, positions, mask).logits(), out, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# objectives


def make_batch(B: int, L: int, first_id: int = 0) -> Batch:
    g = torch.Generator().manual_seed(first_id + 100)
    tokens = torch.randint(0, MASK_ID, (B, L), generator=g)
    loss_mask = torch.rand(B, L, generator=g) < 0.6
    loss_mask[:, 0] = False  # an unsupervised prefix, like a prompt
    loss_mask[:, -1] = True
    return Batch(tokens, loss_mask, torch.arange(first_id, first_id + B, dtype=torch.int64))


# every objective with a small config (block size 4 divides L = 12); schedules where the objective has one
OBJECTIVE_CONFIGS = {
    "mdlm": lambda s: MDLMConfig(schedule=s),
    "bd3lm": lambda s: BD3LMConfig(schedule=s, block_size=4),
    "bd3lm_shift_uniform": lambda s: BD3LMConfig(schedule=s, block_size=4, shift=True, corruption="uniform"),
    "fast_dllm_v2": lambda s: FastDLLMv2Config(block_size=4, sub_block_size=2),
    "uniform": lambda s: UniformConfig(schedule=s),
    "ar": lambda s: ARConfig(),
    "nemotron_diffusion": lambda s: NemotronDiffusionConfig(block_size=4),
}
OBJECTIVE_CASES = [
    (case, sched)
    for case, make in OBJECTIVE_CONFIGS.items()
    for sched in (SCHEDULES.names() if "schedule" in type(make("linear")).model_fields else ["linear"])
]
TOKEN_IDS = TokenIds(mask_id=MASK_ID, eos_id=MASK_ID - 1, pad_id=MASK_ID - 2, num_tokens=V)


# objectives whose inputs are not the batch's [B, L] layout, with the file that holds their contract tests
OWN_CONTRACT = {
    "edit_flow": "tests/unit/test_edit_flow.py",  # variable-length rows; needs model.edit_head
    # [clean ; canvas] rows of 2L; needs a diffusion_gemma model and one supervised suffix per row
    "diffusiongemma_native_sft": "tests/unit/test_diffusion_gemma_sft.py",
}


def test_every_registered_objective_has_a_contract_case():
    # objectives of a frozen target (tag "target": dflash_distillation) train a drafter, not a model on
    # clean targets: their contract is tested in tests/unit/test_dflash.py; OWN_CONTRACT ones in their own tests
    assert {type(make("linear")).model_fields["name"].default for make in OBJECTIVE_CONFIGS.values()} | set(
        OWN_CONTRACT
    ) == set(OBJECTIVES.names()) - set(OBJECTIVES.names("target"))


def build_objective(case: str, schedule: str):
    cfg = OBJECTIVE_CONFIGS[case](schedule)
    return OBJECTIVES.resolve(cfg.name)(cfg, TOKEN_IDS)


def views(inp: ModelInputs, B: int) -> int:
    """How many rows of model input each sample has (Fast-dLLM v2 trains two complementary views)."""
    assert inp.targets_BL.shape[0] % B == 0
    return inp.targets_BL.shape[0] // B


def predictor_positions(inp: ModelInputs) -> torch.Tensor:
    """[rows, L] index of the hidden position that predicts each target."""
    if inp.loss_rows is not None:
        return inp.loss_rows
    return torch.arange(inp.targets_BL.shape[1]).expand_as(inp.targets_BL)


@pytest.fixture(scope="module")
def model():
    return tiny_model(FAMILIES.names()[0]).eval()


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_prepare_contract(name, schedule):
    obj = build_objective(name, schedule)
    batch = make_batch(8, 12)
    inp = obj.prepare(batch, NoiseKeys(0, 8))
    assert isinstance(inp, ModelInputs)
    assert isinstance(inp.mask, AttentionMask)
    n = views(inp, 8)
    m = inp.targets_BL.shape[1] // 12  # terms side by side (nemotron_diffusion: diffusion, next-token)
    assert inp.tokens_BL.shape == inp.positions_BL.shape and inp.tokens_BL.shape[0] == 8 * n
    assert inp.targets_BL.shape == inp.weights_BL.shape == (8 * n, 12 * m)
    assert inp.tokens_BL.dtype == torch.long and inp.positions_BL.dtype == torch.long
    assert inp.weights_BL.is_floating_point()
    assert bool(torch.isfinite(inp.weights_BL).all()) and bool((inp.weights_BL >= 0).all())
    assert bool(((inp.tokens_BL >= 0) & (inp.tokens_BL < V)).all())
    # nothing outside the supervision mask carries loss weight, and the targets are the clean tokens
    assert bool((inp.weights_BL[~batch.loss_mask_BL.repeat(n, m)] == 0).all())
    assert torch.equal(inp.targets_BL, batch.tokens_BL.repeat(n, m))
    assert float(inp.weights_BL.sum()) > 0
    assert obj.normalizer(batch) > 0


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_loss_finite_and_gradients_only_at_supervised_positions(name, schedule, model):
    obj = build_objective(name, schedule)
    batch = make_batch(8, 12)
    inp = obj.prepare(batch, NoiseKeys(0, 8))
    logits = model(inp.tokens_BL, inp.positions_BL, inp.mask).logits().detach().requires_grad_(True)
    out = obj.loss(output_of_logits(logits), inp)
    assert isinstance(out, LossOutput)
    assert out.loss_sum.dim() == 0 and bool(torch.isfinite(out.loss_sum))
    assert float(out.loss_sum.detach()) > 0
    assert all(isinstance(v, torch.Tensor) and bool(torch.isfinite(v.float()).all()) for v in out.metrics.values())
    out.loss_sum.backward()
    grad = logits.grad
    assert grad is not None and bool(torch.isfinite(grad).all())
    # the gradient reaches exactly the hidden positions that predict a supervised, weighted target
    # (a union: one hidden position may predict several targets, e.g. Fast-dLLM v2's two views read the same
    # clean row at a block start)
    weighted = (inp.weights_BL > 0).float()
    expected = torch.zeros(grad.shape[:2]).scatter_reduce(1, predictor_positions(inp), weighted, "amax") > 0
    touched = grad.abs().sum(-1) > 0
    assert not bool((touched & ~expected).any()), "gradient at a position that predicts no target"
    assert bool(touched[expected].any())


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_gradients_reach_model_parameters(name, schedule):
    obj = build_objective(name, schedule)
    m = tiny_model(FAMILIES.names()[0])
    inp = obj.prepare(make_batch(4, 12), NoiseKeys(0, 4))
    obj.loss(output_of_logits(m(inp.tokens_BL, inp.positions_BL, inp.mask).logits()), inp).loss_sum.backward()
    assert all(p.grad is not None and bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    assert float(m.embed_tokens.weight.grad.abs().sum()) > 0


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_deterministic_under_same_noise_keys(name, schedule, model):
    obj = build_objective(name, schedule)
    batch = make_batch(8, 12)
    a = obj.prepare(batch, NoiseKeys(3, 8))
    b = build_objective(name, schedule).prepare(batch, NoiseKeys(3, 8))
    for field in ("tokens_BL", "positions_BL", "targets_BL", "weights_BL"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    logits = model(a.tokens_BL, a.positions_BL, a.mask).logits()
    assert torch.equal(obj.loss(output_of_logits(logits), a).loss_sum, obj.loss(output_of_logits(logits), b).loss_sum)
    c = obj.prepare(batch, NoiseKeys(4, 8))
    if OBJECTIVES.has(OBJECTIVE_CONFIGS[name](schedule).name, "causal"):  # next-token training adds no noise
        assert torch.equal(a.tokens_BL, c.tokens_BL) and torch.equal(a.tokens_BL, batch.tokens_BL)
    else:
        assert not torch.equal(a.tokens_BL, c.tokens_BL), "the noise seed has no effect"


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_noise_is_per_sample(name, schedule):
    """Splitting a batch (micro-batches, ranks) gives every sample the same corruption."""
    obj = build_objective(name, schedule)
    batch = make_batch(8, 12, first_id=8)
    noise = NoiseKeys(1, 8)
    whole = obj.prepare(batch, noise)
    n = views(whole, 8)
    for sl in (slice(0, 3), slice(3, 8)):
        part = obj.prepare(Batch(batch.tokens_BL[sl], batch.loss_mask_BL[sl], batch.sample_ids_B[sl]), noise)
        rows = torch.cat([torch.arange(8)[sl] + v * 8 for v in range(n)])
        assert torch.equal(part.tokens_BL, whole.tokens_BL[rows])
        assert torch.equal(part.weights_BL, whole.weights_BL[rows])


@pytest.mark.parametrize(("name", "schedule"), OBJECTIVE_CASES)
def test_objective_loss_normalisation_ignores_padding(name, schedule, model):
    """Rows of pure padding (unsupervised) add nothing to the loss sum or the normaliser."""
    obj = build_objective(name, schedule)
    batch = make_batch(4, 12)
    pad = Batch(torch.full((2, 12), TOKEN_IDS.pad_id), torch.zeros(2, 12, dtype=torch.bool), torch.tensor([90, 91]))
    padded = Batch(*(torch.cat([a, b]) for a, b in zip(
        (batch.tokens_BL, batch.loss_mask_BL, batch.sample_ids_B), (pad.tokens_BL, pad.loss_mask_BL, pad.sample_ids_B),
        strict=True)))  # fmt: skip
    assert obj.normalizer(padded) == obj.normalizer(batch)
    a, b = obj.prepare(batch, NoiseKeys(0, 6)), obj.prepare(padded, NoiseKeys(0, 6))
    n = views(a, 4)
    rows = torch.cat([torch.arange(4) + v * 6 for v in range(n)])
    assert float(b.weights_BL.sum()) == pytest.approx(float(a.weights_BL.sum()))
    assert torch.equal(b.weights_BL[rows], a.weights_BL)


# --------------------------------------------------------------------------------------------------
# policies


POLICY_SPECIAL = SpecialIds(mask_id=9, pad_id=8, eos_id=7, num_tokens=10)


def policy_inputs(name: str):
    policy = make_policy(SamplerConfig(policy=name, threshold=0.7, factor=1.0), POLICY_SPECIAL)
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(3, 10, generator=g, dtype=torch.float64)
    prop = Proposal(torch.randint(0, 9, (3, 10), generator=g), probs, probs / 2, 1 - probs)
    eligible = torch.rand(3, 10, generator=torch.Generator().manual_seed(2)) < 0.5
    eligible[:, 0] = True
    return policy, prop, probs, eligible


COMMIT_RULES = [n for n in POLICIES.names() if issubclass(POLICIES.resolve(n), (Scheduled, Parallel))]
"""Policies that are a score (scheduled) or a commit rule (parallel); the process policies only step."""


@pytest.mark.parametrize("name", COMMIT_RULES)
def test_policy_contract(name):
    """Scheduled policies score positions (reproducibly; `select_topk` commits k of the eligible ones);
    parallel policies commit a reproducible subset of the eligible positions, at least one per row."""
    policy, prop, probs, eligible = policy_inputs(name)
    if policy.scheduled:
        scores = policy.scores(prop, torch.Generator().manual_seed(1))
        assert scores.shape == probs.shape
        assert scores.is_floating_point() and bool(torch.isfinite(scores).all())
        again = policy.scores(prop, torch.Generator().manual_seed(1))
        assert torch.equal(scores, again), "not reproducible with the same generator"
        k = torch.tensor([1, 0, int(eligible[2].sum())])
        sel = select_topk(scores, eligible, k)
        assert torch.equal(sel.sum(-1), k) and not bool((sel & ~eligible).any())
    else:
        sel = policy.commit(prop, eligible)
        assert sel.dtype == torch.bool and sel.shape == probs.shape
        assert not bool((sel & ~eligible).any()) and bool((sel.sum(-1) >= 1).all())
        assert torch.equal(sel, policy.commit(prop, eligible))
        none = policy.commit(prop, torch.zeros_like(eligible))
        assert not bool(none.any()), "nothing eligible, nothing committed"


@pytest.mark.parametrize("name", POLICIES.names())
def test_policy_step_contract(name):
    """Every policy's step writes only undecided positions, reproducibly with the same generator, and
    decides a whole region within its budget plus one step per position (the loop's overrun)."""
    policy, prop, probs, eligible = policy_inputs(name)
    budget = policy.budget(4, probs.shape[1])

    def state(undecided, step, seed=1):
        schedule = commit_schedule(eligible.sum(-1), budget)
        return StepState(undecided, schedule, step, budget, torch.Generator().manual_seed(seed))

    start = policy.start(state(eligible, 0))
    assert start is None or (start.shape == probs.shape and bool(((start >= 0) & (start < 10)).all()))
    undecided = eligible.clone()
    for k in range(budget + probs.shape[1]):
        if not bool(undecided.any()):
            break
        c = policy.step(prop, state(undecided, k))
        again = policy.step(prop, state(undecided, k))
        assert torch.equal(c.positions_BR, again.positions_BR) and torch.equal(c.tokens_BR, again.tokens_BR)
        assert c.positions_BR.dtype == torch.bool and c.tokens_BR.shape == probs.shape
        written = c.positions_BR if c.renoise_BR is None else c.positions_BR | c.renoise_BR
        assert not bool((written & ~undecided).any()), "wrote a decided position"
        assert not bool((c.tokens_BR == POLICY_SPECIAL.mask_id)[written].any())
        if c.final:
            undecided &= ~c.positions_BR
    assert not bool(undecided.any()), "the region was not decided"
    none = policy.step(prop, state(torch.zeros_like(eligible), 0))
    assert not bool(none.positions_BR.any()), "nothing undecided, nothing committed"


# --------------------------------------------------------------------------------------------------
# attention backends


def dense_reference(q, k, v, mask: AttentionMask):
    B, H, Lq, D = q.shape
    Lk, K = k.shape[2], k.shape[1]
    i = torch.arange(Lq)[:, None]
    j = torch.arange(Lk)[None, :]
    allowed = (i >= j) if mask.kind == "causal" else torch.ones(Lq, Lk, dtype=torch.bool)
    allowed = allowed.expand(B, Lq, Lk).clone()
    if mask.doc_ids_BL is not None:
        allowed &= mask.doc_ids_BL[:, :, None] == mask.doc_ids_BL[:, None, :]
    if mask.key_valid_BL is not None:
        allowed &= mask.key_valid_BL[:, None, :]
    k = k.repeat_interleave(H // K, dim=1)
    v = v.repeat_interleave(H // K, dim=1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v


BACKEND_MASKS = {
    "bidirectional": AttentionMask("bidirectional"),
    "causal": AttentionMask("causal"),
    "padding": AttentionMask(key_valid_BL=torch.tensor([[False, True, True, True, True, True], [True] * 6])),
    "documents": AttentionMask("causal", doc_ids_BL=torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])),
    "padding_documents": AttentionMask(
        key_valid_BL=torch.tensor([[True] * 6, [False, True, True, True, True, True]]),
        doc_ids_BL=torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]]),
    ),
}


@pytest.mark.parametrize("mask_name", sorted(BACKEND_MASKS))
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("backend", ATTENTION_BACKENDS.names())
def test_attention_backend_matches_dense_reference(backend, kv_heads, mask_name):
    attend = make_attention(backend, flex_compile=False)
    mask = BACKEND_MASKS[mask_name]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, kv_heads, 6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    out = attend(q, k, v, mask)
    ref = dense_reference(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


# --------------------------------------------------------------------------------------------------
# sources


def _source_input(kind: str, root: Path) -> tuple[dict, list[str]]:
    """A source config (as YAML would give it) over three documents, and the file its records name."""
    docs = [f"doc {i}" for i in range(3)]
    if kind == "jsonl":
        (root / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
        return {"kind": kind, "path": "d.jsonl"}, "d.jsonl"
    if kind == "text":
        (root / "d.txt").write_text("\n".join(docs) + "\n", encoding="utf-8")
        return {"kind": kind, "path": "d.txt", "per_line": True}, "d.txt"
    if kind == "npy":
        import numpy as np

        np.save(root / "d.npy", np.array([list(d.encode()) for d in docs], dtype=np.int32))
        return {"kind": kind, "path": "d.npy"}, "d.npy"
    if kind == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        import pyarrow as pa

        pq.write_table(pa.table({"text": docs}), root / "d.parquet")
        return {"kind": kind, "path": "d.parquet"}, "d.parquet"
    if kind == "hf_dataset":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(root / "ds"))
        return {"kind": kind, "path": "ds"}, "ds"
    raise AssertionError(f"add an input for source kind {kind!r} to this contract test")


@pytest.mark.parametrize("kind", SOURCES.names())
def test_source_yields_records_in_order_with_locations(kind, tmp_path: Path):
    """Every source: records in order, each naming where it came from, rendering to the documents."""
    from dllm.data.prepare.render import render
    from dllm.tokenization import ByteTokenizer

    assert kind in source_field("kind")
    raw, name = _source_input(kind, tmp_path)
    spec = PrepareSpec.model_validate({"sources": [raw], "output": "out", "seq_len": 8})
    cfg = spec.sources[0]
    records = list(SOURCES.resolve(kind)(cfg, tmp_path))
    tok = ByteTokenizer()
    texts = [tok.decode(render(r, cfg, tok, add_bos=False, append_eos=False).ids) for r in records]
    assert texts == ["doc 0", "doc 1", "doc 2"]
    assert all(name in r.where for r in records)
    assert len({r.where for r in records}) == 3
