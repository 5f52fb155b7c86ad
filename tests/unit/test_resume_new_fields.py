"""Resuming a run saved by an older version: a field added since (with its default) is not a change."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dllm.config.spec import RunSpec
from dllm.errors import CheckpointError
from dllm.training.run import _check_same_model


def _spec(**objective: object) -> RunSpec:
    training = {"steps": 4, "global_batch_size": 2, "micro_batch_size": 2}
    data = {"path": "prepared", "seq_len": 32}
    return RunSpec.model_validate({"objective": {"name": "mdlm", **objective}, "training": training, "data": data})


def _saved(tmp_path: Path, spec: RunSpec, drop: str | None = None, **changed: object) -> Path:
    cfg = spec.model_dump(mode="json")
    if drop is not None:
        del cfg["objective"][drop]
    cfg["objective"].update(changed)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def test_a_field_missing_from_the_saved_config_resumes_at_its_default(tmp_path: Path):
    spec = _spec()
    field = next(k for k, f in type(spec.objective).model_fields.items() if k != "name" and not f.is_required())
    _check_same_model(spec, _saved(tmp_path, spec, drop=field))


def test_a_missing_field_set_away_from_its_default_is_a_change(tmp_path: Path):
    spec = _spec()
    name, value = "time_epsilon", None
    for key, field in type(spec.objective).model_fields.items():
        if isinstance(field.get_default(), float):
            name, value = key, field.get_default() / 2
            break
    assert value is not None
    changed = _spec(**{name: value})
    with pytest.raises(CheckpointError, match=rf"objective\.{name} changed"):
        _check_same_model(changed, _saved(tmp_path, spec, drop=name))


def test_a_changed_field_is_still_refused(tmp_path: Path):
    spec = _spec()
    saved = _saved(tmp_path, spec, name="bd3lm")
    with pytest.raises(CheckpointError, match="different objective"):
        _check_same_model(spec, saved)
