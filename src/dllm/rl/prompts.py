"""The prompts of an rl run (config/rl.py PromptsConfig) as an exact-answer Task (evaluation/tasks.py).

Three sources: a built-in generated task, a JSONL file of prompt/answer records, or a prepared prompts
artifact (`dllm data prepare` with format prompt_completion, supervision completion_only, layout indexed):
each of its samples is the tokenized prompt (unsupervised) followed by the tokenized answer (supervised,
then the EOS that prepare appends or pads with). The answer string is the answer tokens decoded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dllm.config.rl import PromptsConfig
from dllm.data.artifact import Artifact, check_layout, check_values, open_artifact
from dllm.errors import ConfigError, DataError
from dllm.evaluation.tasks import BUILTIN, Example, load_task
from dllm.evaluation.tasks import Task as Task
from dllm.tokenization import Tokenizer

_PREPARE = "prepare it with format prompt_completion, supervision completion_only and layout indexed"


def load_prompts(cfg: PromptsConfig, tok: Tokenizer) -> Task:
    """The built-in task's `num_prompts` generated examples of its train split (never its eval split), or the
    first `num_prompts` records of the JSONL file or prepared artifact at `path`; a ConfigError naming the
    field for an unknown task, or a file or artifact whose records lack a prompt or an answer."""
    if cfg.task is not None:
        if cfg.task not in BUILTIN:
            raise ConfigError(f"rl.prompts.task: unknown task {cfg.task!r}; use one of {', '.join(BUILTIN)}")
        return load_task(cfg.task, cfg.num_prompts, cfg.seed, split="train")  # never the eval split
    assert cfg.path is not None  # PromptsConfig holds exactly one source
    try:
        if cfg.path.is_dir():
            return artifact_task(open_artifact(cfg.path), tok, cfg.num_prompts)
        if not cfg.path.is_file():
            raise ConfigError(
                f"rl.prompts.path: {cfg.path} is neither a JSONL file of prompt/answer records nor a prepared artifact"
            )
        return load_task(str(cfg.path), cfg.num_prompts)
    except DataError as e:
        raise ConfigError(f"rl.prompts.path: {e}") from None


def artifact_task(art: Artifact, tok: Tokenizer, limit: int) -> Task:
    """The first `limit` samples of a prepared prompts artifact as examples (prompt and answer decoded)."""
    check_layout(art)
    check_values(art, trust_recorded=True)
    where = art.path / "manifest.json"
    if art.manifest["layout"] != "indexed":
        raise DataError(f"{where}: layout {art.manifest['layout']} mixes records in rows; {_PREPARE}")
    cut = art.manifest["stats"].get("truncated", 0) if isinstance(art.manifest["stats"], dict) else 0
    if cut:
        raise DataError(f"{where}: {cut} records were truncated (a prompt or answer may be cut); use overflow: reject")
    if art.tokenizer.get("vocab_hash") != tok.identity().get("vocab_hash"):
        raise DataError(f"{where}: prepared with another tokenizer than the run's; use the run's tokenizer section")
    ids, mask = np.asarray(art.array("tokens")), np.asarray(art.array("loss_mask"))
    starts = [int(s) for s in art.array("doc_starts")] + [ids.size]
    examples = []
    for i in range(min(limit, art.num_sequences)):
        sample_ids, sample_mask = ids[starts[i] : starts[i + 1]], mask[starts[i] : starts[i + 1]]
        prompt_ids, answer_ids = _split(sample_ids.tolist(), sample_mask.tolist(), tok, f"{art.path}: sample {i}")
        examples.append(Example(tok.decode(prompt_ids), tok.decode(answer_ids)))
    if not examples:
        raise DataError(f"{where}: no samples")
    longest = max(len(tok.encode(e.answer)) for e in examples)
    return Task(Path(art.path).resolve().name, examples, max(8, longest + 4))


def _split(ids: list[int], mask: list[int], tok: Tokenizer, where: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the unsupervised prefix and the supervised rest without its trailing EOS."""
    k = mask.index(1) if 1 in mask else len(mask)
    if 0 in mask[k:]:
        raise DataError(f"{where}: supervised tokens are not one answer after the prompt; {_PREPARE}")
    answer = ids[k:]
    while answer and answer[-1] == tok.eos_id:
        answer.pop()
    if k == 0:
        raise DataError(f"{where}: no prompt (every token is supervised); {_PREPARE}")
    if not answer:
        raise DataError(f"{where}: no answer (no supervised token other than EOS); {_PREPARE}")
    prompt = ids[1:k] if ids[0] == tok.bos_id else ids[:k]  # the rollout encodes the decoded prompt (no BOS)
    if tok.encode(tok.decode(prompt)) != prompt:
        raise DataError(f"{where}: the tokenizer does not encode the decoded prompt back to its tokens")
    return prompt, answer
