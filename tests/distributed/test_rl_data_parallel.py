"""diffu-GRPO over two gloo processes (training/grpo.py): with the same generated samples (a replay of
fixed completions per prompt), two ranks holding half the prompts each take the one-process step on the
union (DDP and FSDP2); real rollouts under FSDP2 draw rank-disjoint prompts; a two-process resume
between rounds is bit-exact (each rank's generation RNG is in the checkpoint); FSDP2 with LoRA takes
its reference from the base weights (KL 0 before the first update)."""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from dllm.parallel.dims import DistEnv
from dllm.rl.grpo import completion_mask
from dllm.rl.rollout import Rollouts
from dllm.sampling.canvas import left_pad
from dllm.sampling.results import Counters
from dllm.training import grpo as grpo_mod
from dllm.training.build import build_trainer
from dllm.training.preflight import resolve_run_spec
from tests.distributed.harness import run_cases
from tests.helpers import load_spec, write_yaml

pytestmark = pytest.mark.distributed

# 12 prompts of one length: left padding (and so every position) is the same in any subset
PROMPTS = [
    {"prompt": f"{a:02d} + {b:02d} =", "answer": f" {a + b}"} for a, b in zip(range(10, 22), range(40, 52), strict=True)
]
METRICS = ("loss", "kl", "clip_fraction", "grad_norm", "reward_mean", "reward_std", "completion_len")


def replay_rollout(model, examples, task, tok, cfg, special, group_size, rewards, generator) -> Rollouts:
    """Fixed completions: row g of a prompt's group is a function of the prompt text and g only (not of
    the rank, the batch or `generator`), with an EOS at a varying place; the reward is its share of digits."""
    rows, prompt_ids = [], []
    for e in examples:
        for g in range(group_size):
            key = zlib.crc32(f"{e.prompt}|{g}".encode())
            row = torch.randint(40, 60, (cfg.gen_length,), generator=torch.Generator().manual_seed(key))
            row[2 + key % (cfg.gen_length - 2) :] = special.eos_id
            rows.append(row)
            prompt_ids.append(tok.encode(e.prompt))
    completion_BC = torch.stack(rows)
    mask_BC = completion_mask(completion_BC, special.eos_id)
    digits = ((completion_BC >= 48) & (completion_BC < 58) & mask_BC).sum(-1).float()
    rewards_B = digits / mask_BC.sum(-1).float()
    prompt_BP, valid_BP = left_pad(prompt_ids, special.pad_id, torch.device("cpu"))
    correct_B = torch.zeros(len(rows), dtype=torch.bool)
    return Rollouts(
        prompt_BP, valid_BP, completion_BC, mask_BC, rewards_B, {"digits": rewards_B}, correct_B, Counters()
    )


def _yaml(folder: Path, world: int, mode: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS), encoding="utf-8")
    values = {
        "run": {"name": "grpo", "output_dir": str(folder / "runs")},
        "model": {"preset": "tiny"},
        "training": {"steps": 4, "global_batch_size": 16, "micro_batch_size": 2, "grad_clip": 1.0},
        "optimizer": {"lr": 1e-3},
        "scheduler": {"name": "constant"},
        "topology": {"nproc_per_node": world, "data_parallel": mode},
        "logging": {"every_steps": 1, "progress": "off", "tensorboard": "off"},
        "rl": {
            "rewards": [{"name": "exact_answer"}],
            "group_size": 4,
            "inner_updates": 2,
            "beta": 0.1,
            "prompts": {"path": "prompts.jsonl"},
            "sampler": {"gen_length": 8, "temperature": 1.0},
        },
    }
    return write_yaml(folder / "train.yaml", values)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().clone().contiguous() for k, v in get_model_state_dict(model, options=options).items()}


def _run(rank: int, world: int, case: dict[str, Any], env: DistEnv) -> dict[str, Any]:
    """Build and run one trainer (with `stop_steps` it stops there, as a killed run would, and a second
    trainer resumes); rank 0 saves the final weights to case["out"] and returns the metrics."""
    folder = Path(case["folder"])
    spec, _ = resolve_run_spec(load_spec(folder / "train.yaml", *case.get("overrides", [])))
    run_dir = folder / "runs" / case["name"]
    run_dir.mkdir(parents=True, exist_ok=True)
    if case.get("replay"):  # and no prompt masking: its draws come from each rank's own generator
        grpo_mod.rollout = replay_rollout
        spec = spec.model_copy(update={"rl": spec.rl.model_copy(update={"p_mask_prompt": 0.0})})
    trainer = build_trainer(spec, run_dir, env)
    drawn = [e.prompt for e in trainer.draw_prompts(0)]
    if case.get("uneven"):  # as decoding that stops early: forwards on gathered weights need no peer
        tokens_BL = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad(), grpo_mod.gathered_weights(trainer.model):
            for _ in range(3 if rank == 0 else 1):
                trainer.model(tokens_BL, torch.arange(12).expand(2, 12))
    if case.get("stop_steps"):
        trainer.cfg = trainer.cfg.model_copy(update={"steps": case["stop_steps"]})
        trainer.fit()
        trainer.metrics.close()
        trainer = build_trainer(spec, run_dir, env)
    records = [trainer.run_round() for _ in range(case.get("rounds", 0))] if "rounds" in case else None
    if records is None:
        trainer.fit()
        trainer.metrics.close()
    state = _full_state(trainer.model)
    prompts = [None] * world
    torch.distributed.all_gather_object(prompts, drawn) if world > 1 else prompts.__setitem__(0, drawn)
    if rank == 0:
        save_file(state, case["out"])
    ref = trainer.reference
    sharded = ref is not None and isinstance(next(ref.parameters()), DTensor)  # FSDP2: laid out like the policy
    return {"records": records, "prompts": prompts, "step": trainer.step, "ref_sharded": sharded} if rank == 0 else {}


def _run_case(rank: int, world: int, case: dict[str, Any]) -> dict[str, Any]:
    return _run(rank, world, case, DistEnv(rank=rank, local_rank=rank, world_size=world))


def _assert_same_weights(a: Path, b: Path, **tol: float) -> None:
    sa, sb = load_file(str(a)), load_file(str(b))
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=k, **tol)


def test_two_ranks_match_one_on_the_same_samples_and_resume_bit_exact(tmp_path: Path, monkeypatch):
    one = {"folder": str(tmp_path / "one"), "mode": "fsdp", "name": "one", "replay": True, "rounds": 2,
           "out": str(tmp_path / "one.safetensors")}  # fmt: skip
    monkeypatch.setattr(grpo_mod, "rollout", replay_rollout)
    _yaml(tmp_path / "one", 1, "fsdp")
    ref = _run(0, 1, one, DistEnv())
    cases = {
        mode: {
            "folder": str(tmp_path / mode),
            "mode": mode,
            "name": mode,
            "replay": True,
            "rounds": 2,
            "out": str(tmp_path / f"{mode}.safetensors"),
        }  # fmt: skip
        for mode in ("ddp", "fsdp")
    }
    whole = {"folder": str(tmp_path / "real"), "mode": "fsdp", "out": str(tmp_path / "whole.safetensors")}
    cases["whole"] = {**whole, "name": "whole", "overrides": ["training.steps=8"]}
    cases["resumed"] = {**whole, "name": "resumed", "out": str(tmp_path / "resumed.safetensors"), "stop_steps": 4,
                        "overrides": ["training.steps=8", "checkpointing.every_steps=4"]}  # fmt: skip
    lora = ["lora.rank=4", "rl.inner_updates=1"]
    cases["lora"] = {"folder": str(tmp_path / "lora"), "mode": "fsdp", "name": "lora", "rounds": 2,
                     "out": str(tmp_path / "lora.safetensors"), "overrides": lora, "uneven": True}  # fmt: skip
    for case in cases.values():  # written here: the ranks only read them
        _yaml(Path(case["folder"]), 2, case["mode"])
    out = run_cases(tmp_path, 2, cases, _run_case)
    for mode in ("ddp", "fsdp"):
        two = out[mode]
        assert two["prompts"][0] + two["prompts"][1] == ref["prompts"][0], "rank slices of the one-process draw"
        for r1, r2 in zip(ref["records"], two["records"], strict=True):
            assert {k: r2[k] for k in METRICS} == pytest.approx({k: r1[k] for k in METRICS}, rel=1e-5, abs=1e-6)
        assert ref["records"][1]["kl"] > 0 and ref["records"][0]["reward_std"] > 0
        _assert_same_weights(tmp_path / f"{mode}.safetensors", tmp_path / "one.safetensors", rtol=1e-5, atol=1e-5)
    assert out["fsdp"]["ref_sharded"] and not out["ddp"]["ref_sharded"]
    assert not set(out["whole"]["prompts"][0]) & set(out["whole"]["prompts"][1]), "rank-disjoint prompts"
    lora = out["lora"]["records"]  # the reference is the sharded policy with its adapters off: B = 0 at first
    assert lora[0]["kl"] == 0.0 and lora[1]["kl"] > 0.0
    assert out["resumed"]["step"] == out["whole"]["step"] == 8
    _assert_same_weights(tmp_path / "whole.safetensors", tmp_path / "resumed.safetensors", rtol=0, atol=0)
