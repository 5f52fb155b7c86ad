"""A prepared artifact of a frozen target's features for dflash_distillation (`objective.feature_cache`).

Training a DFlash drafter runs the frozen target once per micro-batch (objective step 1 in dflash.py).
When the same data is seen over many epochs, or the target is much larger than the drafter, one pass
of the target over the data artifact can be stored instead: per sequence, the captured block outputs
(the context features [L, F]) and the target's final hidden states [L, E] (its LM head, which the
drafter shares, turns them into the teacher's logits at training time).

The folder: `manifest.json` (format, the target's identity as drafters record it, the layer ids, the
data artifact's fingerprint, the shards) and `features-NNNNN.safetensors` shards of `rows_per_shard`
sequences: `key` [n, 32] (uint8, the SHA-256 of the sequence's token and document ids: a sequence's
features are a function of those only, whatever stream position or epoch reads it), `features` [n, L, F]
and `hidden` [n, L, E] in the target's dtype. Written in a temp folder and renamed into place.
A cache made from another target (architecture, embedding or weights) or other layers is refused in one line.

Shapes: B batch, L sequence, E hidden, F features, n sequences of a shard.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from dllm.attention.masks import AttentionMask
from dllm.data.loader import Batch
from dllm.errors import CheckpointError
from dllm.models.capture import capture_layers
from dllm.models.dflash_io import target_identity
from dllm.models.transformer import Transformer

FORMAT = "dllm.dflash_features.v1"
MANIFEST = "manifest.json"
_IDENTITY_KEYS = ("config_sha256", "embedding_shape", "weights_sha256")


def sequence_keys(batch: Batch) -> list[bytes]:
    """Per row: the SHA-256 of its token ids (and document ids, which shape its causal mask)."""
    tokens = batch.tokens_BL.to("cpu", torch.int64).numpy()
    docs = None if batch.doc_ids_BL is None else batch.doc_ids_BL.to("cpu", torch.int64).numpy()
    keys = []
    for r in range(tokens.shape[0]):
        h = hashlib.sha256(tokens[r].tobytes())
        if docs is not None:
            h.update(docs[r].tobytes())
        keys.append(h.digest())
    return keys


@torch.no_grad()
def target_pass(target: Transformer, layer_ids: Sequence[int], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen target over a batch, causally: (captured features [B, L, F], final hidden states [B, L, E])."""
    B, L = batch.tokens_BL.shape
    with capture_layers(target, layer_ids) as captured:
        positions = torch.arange(L, device=batch.tokens_BL.device).expand(B, L)
        out = target(batch.tokens_BL, positions, AttentionMask("causal", doc_ids_BL=batch.doc_ids_BL))
    return captured.features(), out.hidden_BLE


def write_feature_cache(
    folder: Path,
    target: Transformer,
    layer_ids: Sequence[int],
    batches: Iterable[Batch],
    *,
    artifact_fingerprint: str | None = None,
    target_name: str | None = None,
    rows_per_shard: int = 1024,
) -> Path:
    """Run `target` over every batch and write the cache folder (staged, then renamed into place)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    stage = folder.with_name(folder.name + ".partial")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    shards: list[dict[str, Any]] = []
    pending: dict[str, list[torch.Tensor]] = {"key": [], "features": [], "hidden": []}

    def flush() -> None:
        if not pending["key"]:
            return
        name = f"features-{len(shards):05d}.safetensors"
        tensors = {k: torch.cat(v).contiguous().cpu() for k, v in pending.items()}
        save_file(tensors, str(stage / name))
        shards.append({"file": name, "num_sequences": int(tensors["key"].shape[0])})
        for v in pending.values():
            v.clear()

    for batch in batches:
        features, hidden = target_pass(target, layer_ids, batch)
        keys = torch.tensor([list(k) for k in sequence_keys(batch)], dtype=torch.uint8)
        start = 0
        while start < len(keys):  # fill the open shard, flush it when full
            part = slice(start, start + rows_per_shard - sum(len(k) for k in pending["key"]))
            pending["key"].append(keys[part])
            pending["features"].append(features[part])
            pending["hidden"].append(hidden[part])
            start += len(keys[part])
            if sum(len(k) for k in pending["key"]) >= rows_per_shard:
                flush()
    flush()
    manifest = {
        "format": FORMAT,
        "target": target_identity(target, target_name),
        "target_layer_ids": list(layer_ids),
        "artifact_fingerprint": artifact_fingerprint,
        "shards": shards,
    }
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    stage.rename(folder)
    return folder


class FeatureCache:
    """An opened cache, checked against the target and layer ids it must come from; `lookup` by batch."""

    def __init__(
        self, folder: Path, target: Transformer, layer_ids: Sequence[int], artifact_fingerprint: str | None = None
    ) -> None:
        from safetensors.torch import load_file

        self.folder = Path(folder)
        where = f"objective.feature_cache {self.folder}"
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{where}: no readable {MANIFEST} ({e}); remove the folder to rebuild it") from None
        if manifest.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a DFlash feature cache (format {manifest.get('format')!r})")
        saved, given = manifest.get("target") or {}, target_identity(target)
        for key in _IDENTITY_KEYS:
            if saved.get(key) != given[key]:
                raise CheckpointError(
                    f"{where}: made from target {saved.get('name') or '(unnamed)'}, and this target's "
                    f"{key.split('_')[0]} differs; remove the folder to rebuild it for this target"
                )
        if list(manifest.get("target_layer_ids") or []) != list(layer_ids):
            raise CheckpointError(
                f"{where}: holds target layers {manifest.get('target_layer_ids')}, not objective.target_layer_ids "
                f"{list(layer_ids)}; remove the folder to rebuild it"
            )
        made_from = manifest.get("artifact_fingerprint")
        if artifact_fingerprint is not None and made_from is not None and made_from != artifact_fingerprint:
            raise CheckpointError(f"{where}: made from another data artifact (fingerprint {made_from}, not "
                                  f"{artifact_fingerprint}); remove the folder to rebuild it")  # fmt: skip
        self.manifest = manifest
        self.features: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.index: dict[bytes, tuple[int, int]] = {}
        for s, shard in enumerate(manifest["shards"]):
            tensors = load_file(str(self.folder / shard["file"]))
            self.features.append(tensors["features"])
            self.hidden.append(tensors["hidden"])
            for i, key in enumerate(tensors["key"].numpy()):
                self.index[key.tobytes()] = (s, i)

    def lookup(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(features [B, L, F], hidden [B, L, E]) of the batch's rows, on its device."""
        rows = []
        for r, key in enumerate(sequence_keys(batch)):
            if key not in self.index:
                raise CheckpointError(
                    f"objective.feature_cache {self.folder}: sequence {int(batch.sample_ids_B[r])} is not in the cache "
                    "(built from another data artifact?); remove the folder to rebuild it"
                )
            rows.append(self.index[key])
        device = batch.tokens_BL.device
        features = torch.stack([self.features[s][i] for s, i in rows]).to(device)
        hidden = torch.stack([self.hidden[s][i] for s, i in rows]).to(device)
        return features, hidden
