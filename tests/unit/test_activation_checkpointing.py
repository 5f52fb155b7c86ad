"""Activation checkpointing (parallel/checkpointing.py): full and selective reproduce the loss and
every parameter gradient of the plain model (fp32, max relative difference <= 1e-6; bit-identical in
practice), keep parameter names, keep strictly less activation memory (full < selective < none), leave
gradient-free and cached forwards alone, and compose with block.compile().

Relative difference of a tensor: max |a - b| / max |b|.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.config.objectives import BD3LMConfig, MDLMConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives import BD3LMObjective, MDLMObjective, TokenIds
from dllm.models import Transformer
from dllm.parallel.checkpointing import (
    apply_activation_checkpointing,
    checkpointing_mode,
    saved_activation_bytes,
    saved_ops,
    selective_policy,
)
from dllm.training.trainer import run_model

V = 40
IDS = TokenIds(mask_id=V - 1, eos_id=V - 2, pad_id=V - 3, num_tokens=V)
B, L, BLOCK = 2, 32, 4
MODELS = {
    "dense": {},  # llama layout
    "moe": {"family": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2},
}


def _model(kind: str, mode: str = "none") -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, **MODELS[kind]))
    model.init_weights(torch.Generator().manual_seed(0))
    return apply_activation_checkpointing(model, mode)


def _objective(name: str):
    return MDLMObjective(MDLMConfig(), IDS) if name == "mdlm" else BD3LMObjective(BD3LMConfig(block_size=BLOCK), IDS)


def _inputs(obj):
    """Two packed rows of three documents (document masks), one unsupervised prompt."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V - 3, (B, L), generator=g)
    sup = torch.ones(B, L, dtype=torch.bool)
    sup[0, :5] = False
    docs = torch.tensor([[0] * 11 + [1] * 13 + [2] * 8, [0] * 19 + [1] * 13])
    return obj.prepare(Batch(tokens, sup, torch.arange(B), docs), NoiseKeys(0, B))


def _loss(model, obj, inputs) -> torch.Tensor:
    out = run_model(model, inputs)
    loss = obj.loss(out, inputs).loss_sum
    router = out.aux.get("router_loss")
    return loss if router is None else loss + router  # the MoE router's loss goes through the blocks too


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _step(model, obj, inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = _loss(model, obj, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], tuple]:
    """The plain (mode none) step of each (objective, model)."""
    out = {}
    for objective in ("mdlm", "bd3lm"):
        obj = _objective(objective)
        for kind in MODELS:
            out[objective, kind] = _step(_model(kind), obj, _inputs(obj))
    return out


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("objective", ["mdlm", "bd3lm"])
def test_loss_and_gradients_equal_no_checkpointing(references, objective: str, kind: str, mode: str):
    obj = _objective(objective)
    model = _model(kind, mode)
    assert checkpointing_mode(model) == mode
    loss, grads = _step(model, obj, _inputs(obj))
    ref_loss, ref_grads = references[objective, kind]
    assert _rel(loss, ref_loss) <= 1e-6
    assert grads.keys() == ref_grads.keys()
    worst = max(grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert _rel(grads[worst], ref_grads[worst]) <= 1e-6, worst


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_names_and_state_dict_unchanged(mode: str):
    plain, checkpointed = _model("moe"), _model("moe", mode)
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert [n for n, _ in checkpointed.named_buffers()] == [n for n, _ in plain.named_buffers()]
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    checkpointed.load_state_dict(plain.state_dict())  # strict: a plain checkpoint loads as is


def test_none_is_a_no_op_and_errors():
    model = _model("dense")
    assert apply_activation_checkpointing(model, "none") is model
    assert checkpointing_mode(model) == "none" and "forward" not in vars(model.layers[0])
    with pytest.raises(ValueError, match="unknown activation checkpointing mode 'partial'"):
        apply_activation_checkpointing(model, "partial")
    apply_activation_checkpointing(model, "full")
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_checkpointing(model, "selective")


def test_deepcopy_checkpoints_the_copy():
    """The per-instance forward is a bound method: a deep copy runs its own block, not the original's."""
    model = _model("dense", "full")
    clone = copy.deepcopy(model)
    assert clone.layers[0].forward.__self__ is clone.layers[0]
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(0.5)
    obj = _objective("mdlm")
    inputs = _inputs(obj)
    assert not torch.equal(_loss(clone, obj, inputs), _loss(model, obj, inputs))


def _count_checkpoints(monkeypatch) -> list[int]:
    import dllm.parallel.checkpointing as ckpt

    calls: list[int] = []
    real = ckpt.checkpoint

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ckpt, "checkpoint", counting)
    return calls


def test_no_grad_forward_skips_checkpointing(monkeypatch):
    """Sampling, evaluation and the self-conditioning pass run without gradients: plain forward."""
    calls = _count_checkpoints(monkeypatch)
    model = _model("dense", "full")
    obj = _objective("mdlm")
    inputs = _inputs(obj)
    with torch.no_grad():
        hidden = run_model(model, inputs).hidden_BLE
    assert calls == []
    assert torch.equal(hidden, run_model(_model("dense"), inputs).hidden_BLE.detach())
    run_model(model, inputs)
    assert len(calls) == len(model.layers)  # the check above would see a real checkpoint


def test_kv_cache_forward_skips_checkpointing(monkeypatch):
    """A block given a KV cache (sampling.cache) calls its plain forward, even with gradients on."""
    calls = _count_checkpoints(monkeypatch)
    block = _model("dense", "full").layers[0]

    class NoCache:
        def update(self, k, v):
            return k, v

    from dllm.attention.masks import AttentionMask

    x = torch.randn(1, 8, 64, requires_grad=True)
    out, _ = block(x, None, AttentionMask(), None, NoCache())
    assert calls == [] and out.requires_grad
    block(x, None, AttentionMask())
    assert calls == [1]


def test_selective_policy_saves_matmuls_and_attention_only():
    aten = torch.ops.aten
    policy = torch.utils.checkpoint.CheckpointPolicy
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert selective_policy(None, op) == policy.MUST_SAVE
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in saved_ops()
    assert torch.ops._c10d_functional.reduce_scatter_tensor.default in saved_ops()
    for op in (aten.mul.Tensor, aten.add.Tensor, aten.rsqrt.default, aten.silu.default, aten._softmax.default):
        assert selective_policy(None, op) == policy.PREFER_RECOMPUTE
    assert torch.ops.c10d._allgather_base_.default not in saved_ops()  # in-place: recomputed (module doc)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("objective", ["mdlm", "bd3lm"])
def test_saved_activation_bytes_ordered(objective: str, kind: str):
    obj = _objective(objective)
    inputs = _inputs(obj)
    saved = {}
    for mode in ("none", "selective", "full"):
        model = _model(kind, mode)
        saved[mode] = saved_activation_bytes(lambda model=model: _loss(model, obj, inputs), exclude=model)
    assert 0 < saved["full"] < saved["selective"] < saved["none"], saved
    assert saved["selective"] < 0.75 * saved["none"], saved  # matmul inputs made by pointwise ops are gone


def test_saved_activation_bytes_matches_saved_tensors_without_checkpointing():
    """Without checkpointing, the meter counts what autograd's saved-tensor hooks see (storages not of
    parameters), up to the batch inputs the hooks also see (made before the forward, not counted)."""
    obj = _objective("mdlm")
    inputs = _inputs(obj)
    model = _model("dense")
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    hooked: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (ptr := t.untyped_storage().data_ptr()) not in params:
            hooked[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = _loss(model, obj, inputs)
    del loss
    metered = saved_activation_bytes(lambda: _loss(model, obj, inputs), exclude=model)
    inputs_bytes = sum(t.untyped_storage().nbytes() for t in vars(inputs).values() if isinstance(t, torch.Tensor))
    assert sum(hooked.values()) - inputs_bytes <= metered <= sum(hooked.values()), (metered, hooked)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compile_traces_the_checkpointed_block(mode: str):
    """block.compile() after checkpointing (apply.py's order) captures each block whole, checkpoint
    included (a graph break inside a checkpointed region would send dynamo back to eager for the block)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs: list[torch.fx.GraphModule] = []

    def recording(gm: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(gm)
        return gm.forward

    model = _model("dense", mode)
    for block in model.layers:
        block.compile(backend=recording)
    obj = _objective("mdlm")
    loss, grads = _step(model, obj, _inputs(obj))
    assert not counters["graph_break"], list(counters["graph_break"])
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert graphs and any("tag_activation_checkpoint" in t for t in targets)
    ref_loss, ref_grads = _step(_model("dense"), obj, _inputs(obj))
    assert _rel(loss, ref_loss) <= 1e-6 and max(_rel(grads[n], ref_grads[n]) for n in grads) <= 1e-6


@pytest.mark.slow  # ~25 s with a cold inductor cache
def test_inductor_compiled_selective_step_equals_compiled_plain_step():
    """The training path (inductor): selective checkpointing compiled equals the compiled plain model."""
    torch._dynamo.reset()
    obj = _objective("mdlm")
    inputs = _inputs(obj)
    steps = {}
    for mode in ("none", "selective"):
        model = _model("dense", mode)
        for block in model.layers:
            block.compile()
        steps[mode] = _step(model, obj, inputs)
    (loss, grads), (ref_loss, ref_grads) = steps["selective"], steps["none"]
    assert _rel(loss, ref_loss) <= 1e-6
    assert max(_rel(grads[n], ref_grads[n]) for n in grads) <= 1e-6


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_replays_the_rng(mode: str):
    """LoRA dropout draws from the global RNG: the recompute restores the RNG state, so it draws the
    forward's masks again and the adapter gradients equal the plain model's."""
    from dllm.config.model import LoraConfig
    from dllm.models.lora import apply_lora

    obj = _objective("mdlm")
    inputs = _inputs(obj)
    steps = {}
    for m in ("none", mode):
        model = _model("dense")
        apply_lora(model, LoraConfig(rank=4, dropout=0.5), torch.Generator().manual_seed(1))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(generator=torch.Generator().manual_seed(2))  # B = 0 would hide A's gradient
        apply_activation_checkpointing(model, m)
        torch.manual_seed(0)
        steps[m] = _step(model, obj, inputs)
    (loss, grads), (ref_loss, ref_grads) = steps[mode], steps["none"]
    lora = [n for n in grads if "lora_" in n]
    assert lora and all(grads[n] is not None and bool(grads[n].any()) for n in lora)
    assert _rel(loss, ref_loss) <= 1e-6
    assert max(_rel(grads[n], ref_grads[n]) for n in lora) <= 1e-6


def test_saved_activation_bytes_counts_what_reuses_a_storage_freed_in_place():
    """FSDP2 frees its gathered parameters' memory in place (storage.resize_(0)) during the forward; the
    allocator may hand that address to a later activation, which must still be counted (the meter keys
    storages by identity, not by data pointer)."""
    x0 = torch.randn(64, 64, requires_grad=True)
    emptied: list[torch.Tensor] = []  # the storages live on, empty, as FSDP2's parameters' do

    def forward() -> torch.Tensor:
        x = x0
        for _ in range(8):
            buffer = torch.empty(64, 64)
            buffer.untyped_storage().resize_(0)
            emptied.append(buffer)
            x = x.exp()  # same size as the freed buffer; exp keeps its result for the backward
        return x.sum()

    assert saved_activation_bytes(forward) == 8 * 64 * 64 * 4 + 4  # + the returned sum
