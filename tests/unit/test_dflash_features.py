"""objective.feature_cache: the target's features precomputed into a prepared folder train exactly as the
on-the-fly target pass (1e-6); a cache from another target, other layers or other data is refused in one
line; a drafter run builds the cache when missing and its losses equal the run without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.dflash_features import MANIFEST, FeatureCache, write_feature_cache
from dllm.errors import CheckpointError
from dllm.training.trainer import run_model
from tests.unit.test_dflash import LAYERS, make_batch, make_drafter, make_objective, make_target, write_causal_target


def _rows(batch: Batch, rows: slice) -> Batch:
    return Batch(batch.tokens_BL[rows], batch.loss_mask_BL[rows], batch.sample_ids_B[rows])


def _cache(folder: Path, target, batch: Batch) -> FeatureCache:
    # the cache is written from other groupings of the rows (and in 2-row shards) than training reads them
    write_feature_cache(folder, target, LAYERS, [_rows(batch, slice(0, 3)), _rows(batch, slice(3, 5))],
                        rows_per_shard=2, target_name="tiny", artifact_fingerprint="data-a")  # fmt: skip
    return FeatureCache(folder, target, LAYERS)


def _step(objective, drafter, batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], object]:
    drafter.zero_grad(set_to_none=True)
    inputs = objective.prepare(batch, NoiseKeys(0, 5))
    loss = objective.loss(run_model(drafter, inputs), inputs).loss_sum
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}, inputs


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_training_from_the_cache_equals_training_on_the_fly(tmp_path: Path, loss: str):
    target = make_target()
    drafter = make_drafter(target, num_layers=2)
    batch = make_batch(B=5)
    cache = _cache(tmp_path / "features", target, batch)
    assert len(cache.manifest["shards"]) == 3  # 2 + 2 + 1 rows
    on_the_fly = make_objective(target, loss=loss)
    cached = make_objective(target, loss=loss)
    cached.features = cache
    for rows in (slice(0, 2), slice(1, 5)):  # micro-batches that cut across the written groupings
        ref_loss, ref_grads, ref_in = _step(on_the_fly, drafter, _rows(batch, rows))
        got_loss, got_grads, got_in = _step(cached, drafter, _rows(batch, rows))
        torch.testing.assert_close(got_in.tokens_BL.context_BCF, ref_in.tokens_BL.context_BCF, atol=1e-6, rtol=1e-6)
        assert torch.equal(got_in.targets_BL, ref_in.targets_BL)
        torch.testing.assert_close(got_loss, ref_loss, atol=1e-6, rtol=1e-6)
        for name, g in ref_grads.items():
            torch.testing.assert_close(got_grads[name], g, atol=1e-6, rtol=1e-6, msg=name)


def test_a_cache_of_another_target_layers_or_data_is_refused(tmp_path: Path):
    target = make_target()
    batch = make_batch(B=5)
    _cache(tmp_path / "features", target, batch)
    with pytest.raises(CheckpointError, match=r"made from target tiny, and this target's weights differs") as e:
        FeatureCache(tmp_path / "features", make_target(seed=1), LAYERS)
    assert "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match=r"holds target layers \[0, 2\], not objective.target_layer_ids \[1\]"):
        FeatureCache(tmp_path / "features", target, [1])
    with pytest.raises(CheckpointError, match="made from another data artifact"):
        FeatureCache(tmp_path / "features", target, LAYERS, artifact_fingerprint="data-b")
    cache = FeatureCache(tmp_path / "features", target, LAYERS)
    other = make_batch(B=2, seed=9)
    with pytest.raises(CheckpointError, match="sequence 0 is not in the cache"):
        cache.lookup(other)


def test_a_drafter_run_builds_the_cache_and_trains_as_without_it(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    import dllm.training.progress as progress
    from dllm.training.build import build_trainer
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir
    from tests.helpers import load_spec, tiny_train_values, write_yaml

    write_causal_target(workdir / "target")
    objective = {"name": "dflash_distillation", "target": "target", "target_layer_ids": [0, 2], "block_size": 4,
                 "num_anchors": 4}  # fmt: skip
    counted: list[tuple[int, int]] = []  # the cache's progress: (sequences counted, total)

    class Counting(progress.CountBar):
        def close(self) -> None:
            counted.append((self.done, self.total))
            super().close()

    monkeypatch.setattr(progress, "CountBar", Counting)
    losses = {}
    for name, extra in (("fly", {}), ("cached", {"feature_cache": "features"})):
        values = tiny_train_values(objective={**objective, **extra}, training={"steps": 2})
        spec, _ = resolve_run_spec(load_spec(write_yaml(workdir / f"{name}.yaml", values), f"run.name={name}"))
        trainer = build_trainer(spec, prepare_run_dir(spec))
        assert (trainer.objective.features is not None) == (name == "cached")
        losses[name] = trainer.fit()
        trainer.metrics.close()
    assert (workdir / "features" / MANIFEST).is_file()
    assert len(counted) == 1 and counted[0][0] == counted[0][1] > 0  # every sequence counted once
    assert len(losses["fly"]) == 2
    assert losses["cached"] == pytest.approx(losses["fly"], rel=1e-6, abs=1e-7)
