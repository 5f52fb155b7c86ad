"""A2D of SmolLM2-135M-Instruct: converted diffusion models against their AR original, side by side, held out.

The AR original is the folder `dllm convert --from-gguf` makes of the packaged GGUF file (tests/real_model.py
builds it once, in a cache outside the repository); each converted model is a run of a recipe
(a2d-smollm2-mdlm, a2d-smollm2-fast-dllm-v2), given as NAME=RUN_DIR. One process, one JSON line:

(o) overlap: per run, how many of the items scored below appear in the run's training artifact (the
    chat tasks' eval questions, and the held-out open prompts, each looked up as a question:
    evaluation/overlap.py, as `dllm eval tasks --run` does). Every number below is held out only
    where these are 0; the bench refuses to go on otherwise (unless --allow-overlap);
(a) accuracy on the eval split of the chat tasks (evaluation/facts.py: capitals, arithmetic, units, reverse,
    yesno; half of each table by a stable hash, never in any training set the project builds): the AR
    original (greedy, KV cache) and each run at each sampler setting (below), the same verifiers;
(g) agreement with the AR original on --open-prompts held-out open instructions (data/instructions.py: the
    topics no training prompt of the recipes names), up to --open-new tokens each: ROUGE-L F1 (longest
    common subsequence of words) and bag-of-words token F1 (SQuAD's), mean over prompts, of each run's
    answer (its fast setting) against the AR original's greedy answer;
(s) speed on --speed-prompts of those prompts, --open-new tokens: tokens/s (answer tokens up to EOS over
    wall time) and forwards per token (model forwards per answer token of a row: nfe x batch / tokens)
    of each run's fast setting against the AR original with its KV cache, at batch 1 and 8; after one
    warm-up call of each, rounds interleave the variants (A B C, B C A, ...), medians reported;
(c) confidence, why a run takes the forwards it takes: on the --speed-prompts prompts at batch 1, its fast setting,
    at every threshold step the top-token probability of the 1st, 2nd, 3rd and 4th undecided position of the
    region (left to right; the 1st is predicted from a decided left neighbour, the 2nd from a masked one): the
    share at >= 0.9, 0.7 and 0.5 and the median, so forwards per token against each threshold; for the AR
    original the probability of each greedy token it chose (the ceiling of the 1st position);
(k) ceiling, what threshold decoding could reach with a model that knows exactly what the AR original knows:
    along the AR original's greedy answers to the --speed-prompts prompts, at each decided prefix, the top
    probability of the marginal of the 2nd and 3rd undecided positions under the AR original's own next-token
    distributions (sum over the --ceiling-top most likely 1st tokens, or pairs, of their probability x the
    AR original's distribution after them; bounded in [counted, counted + the probability left out]), the
    share of its argmax that is the AR original's greedy token, and the forwards per token of a decode that
    commits the 2nd and 3rd positions wherever that bound passes each of 0.9, 0.7, 0.5 (a converted model
    distilled on greedy answers may be surer than this; one that learned the AR original's distributions is not);
    and tau (tokens per target forward) of lossless speculative decoding with a parallel drafter (DFlash: every
    draft from the context alone) that drafts the argmax of these marginals, 3 drafts a round;
(l) likelihood on --likelihood-rows held-out responses: the AR original's greedy answers to held-out open
    prompts (the distribution the runs were distilled towards, on topics they never saw), prepared as
    the recipes prepare their data (chat turns, the answer supervised); the AR original's exact NLL per
    token against each run's Monte Carlo bound (negative ELBO per token, --mc-samples stratified samples
    per row), with the bound's Monte Carlo and data standard errors.

Sampler settings of a run (all greedy): `quality`, one token per step with the low-confidence policy
(bidirectional runs in blocks of 32 without a cache; block runs with their exact block cache), and `fast`,
the threshold policy (0.9) with a cache (dual for bidirectional runs, block for block runs);
--threshold-sweep adds the fast setting at other thresholds (`threshold_<t>`: the accuracy against
forwards per answer trade-off), --settings keeps the named ones only (and the speed and confidence sections
time its threshold settings instead of the fast one). An accuracy row's `tokens_per_forward`
is run_task's count of canvas positions committed per forward, the EOS fill after an answer included (so
not answer tokens: the AR original reports more than 1 there too).

    python bench/real_a2d.py --run mdlm=RUN_DIR --run fast_dllm_v2=RUN_DIR [--ar-model DIR] [--limit 1000]
        [--open-prompts 100] [--open-new 128] [--speed-prompts 8] [--rounds 3] [--likelihood-rows 200]
        [--mc-samples 8] [--ceiling-top 16] [--allow-overlap]
        [--sections overlap,accuracy,agreement,speed,confidence,ceiling,likelihood]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.real_model, from a checkout

from tests import real_model as rm  # noqa: E402

TASKS = ("capitals", "arithmetic", "units", "reverse", "yesno")
SECTIONS = ("overlap", "accuracy", "agreement", "speed", "confidence", "ceiling", "likelihood")
CUTS = (0.9, 0.7, 0.5)
_WORD = re.compile(r"\w+")


def progress(msg: str) -> None:
    print(f"[real_a2d {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


# -- models and settings ------------------------------------------------------------------------------------
def settings(profile, sweep: tuple[float, ...] = ()) -> dict[str, dict]:
    """The sampler fields of a run's `quality` and `fast` settings (see the module doc), by its attention;
    `sweep`: more threshold settings (`threshold_<t>`, the fast setting at another threshold)."""
    if profile.attention == "block":
        out = {"quality": {"policy": "low_confidence", "cache": "block"},
               "fast": {"policy": "threshold", "threshold": 0.9, "cache": "block"}}  # fmt: skip
    else:
        out = {"quality": {"policy": "low_confidence", "cache": "none", "block_length": 32},
               "fast": {"policy": "threshold", "threshold": 0.9, "cache": "dual", "block_length": 32}}  # fmt: skip
    return out | {f"threshold_{t:g}": {**out["fast"], "threshold": t} for t in sweep}


def sampler_for(loaded, fields: dict, gen_length: int):
    """A resolved sampler of `fields` for `gen_length` tokens (whole blocks; one token per step)."""
    from dllm.config.sampler import SamplerConfig, resolve_sampler

    if fields.get("generation") == "causal":
        return resolve_sampler(SamplerConfig(gen_length=gen_length, generation="causal"), loaded.profile)
    block = fields.get("block_length") or loaded.profile.block_size or gen_length
    n = -(-gen_length // block) * block
    return resolve_sampler(SamplerConfig(gen_length=n, steps=n, **fields), loaded.profile)


def setup(loaded, fields: dict, gen_length: int):
    from dllm.inference.assembly import SamplingSetup
    from dllm.sampling.canvas import SpecialIds

    return SamplingSetup(loaded, sampler_for(loaded, fields, gen_length), SpecialIds.of(loaded.profile),
                         torch.device("cpu"))  # fmt: skip


def chat_encoder(loaded):
    tok = loaded.tokenizer
    return lambda text: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True).ids


# -- (o) overlap --------------------------------------------------------------------------------------------
def overlap(runs: dict, tasks: list, open_prompts: list[str]) -> dict:
    from dllm.data.artifact import open_artifact
    from dllm.evaluation.overlap import found_in_artifact
    from dllm.evaluation.tasks import Example

    out = {}
    for name, (loaded, _) in runs.items():
        art = open_artifact(loaded.spec.data.path)
        found = {t.name: sum(found_in_artifact(art, loaded.tokenizer, t.examples, question_only=True)) for t in tasks}
        opens = [Example(p, "") for p in open_prompts]
        found["open_prompts"] = sum(found_in_artifact(art, loaded.tokenizer, opens, question_only=True))
        found["items_checked"] = sum(len(t.examples) for t in tasks) + len(opens)
        out[name] = found
        progress(f"overlap {name}: {found}")
    return out


def timed_settings(runs: dict, keep: str | None) -> dict:
    """The run settings the speed and confidence sections time: each run's fast one, or with --settings the
    named threshold ones (keyed NAME, or NAME/SETTING for a setting other than fast)."""
    out = {}
    for name, (loaded, setts) in runs.items():
        chosen = [s for s in setts if s in keep.split(",") and setts[s]["policy"] == "threshold"] if keep else []
        for setting in chosen or ["fast"]:
            out[name if setting == "fast" else f"{name}/{setting}"] = (loaded, setts[setting])
    return out


# -- (a) accuracy -------------------------------------------------------------------------------------------
def accuracy(ar, runs: dict, tasks: list, batch: int, keep: str | None = None) -> dict:
    from dllm.cli.eval_cmd import task_sampler
    from dllm.evaluation.tasks import run_task

    variants = {"ar": (ar, {"generation": "causal"})}
    for name, (loaded, setts) in runs.items():
        variants |= {f"{name}/{s}": (loaded, fields) for s, fields in setts.items() if not keep or s in keep.split(",")}
    out: dict = {}
    for vname, (loaded, fields) in variants.items():
        row, right, total = {}, 0, 0
        for task in tasks:
            s = setup(loaded, fields, task.max_new_tokens)
            gen = torch.Generator().manual_seed(0)
            r = run_task(task, task_sampler(s, task, False, gen), batch)
            row[task.name] = {"accuracy": round(r.accuracy, 4), "correct": r.correct, "n": r.examples,
                              "forwards_per_answer": round(r.forwards_per_answer, 2),
                              "tokens_per_forward": round(r.tokens_per_forward, 2),
                              "wall_s": round(r.wall_s, 1)}  # fmt: skip
            right, total = right + r.correct, total + r.examples
            progress(f"accuracy {vname} {task.name}: {r.correct}/{r.examples}")
        row["all"] = {"accuracy": round(right / total, 4), "correct": right, "n": total,
                      "macro_accuracy": round(statistics.mean(row[t.name]["accuracy"] for t in tasks), 4)}  # fmt: skip
        out[vname] = row
    for name in runs:
        best = max((v for v in out if v.startswith(f"{name}/")), key=lambda v: out[v]["all"]["accuracy"])
        kept = out[best]["all"]["accuracy"] / max(out["ar"]["all"]["accuracy"], 1e-9)
        out[f"{name}_best"] = {"setting": best.split("/")[1], "kept_of_ar": round(kept, 4)}
    return out


# -- (g) agreement ------------------------------------------------------------------------------------------
def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over lowercase words: the longest common subsequence against both lengths."""
    a, b = words(candidate), words(reference)
    if not a or not b:
        return float(a == b)
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(a), lcs / len(b)
    return 2 * p * r / (p + r)


def token_f1(candidate: str, reference: str) -> float:
    """SQuAD's F1: the overlap of the two bags of lowercase words."""
    a, b = words(candidate), words(reference)
    if not a or not b:
        return float(a == b)
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    p, r = common / len(a), common / len(b)
    return 2 * p * r / (p + r)


def answers(loaded, fields: dict, prompts: list[str], num_new: int, batch: int) -> list[str]:
    from dllm.cli.sampling_common import decode_batches

    s = setup(loaded, fields, num_new)
    decoded = decode_batches(s, prompts, chat_encoder(loaded), batch, torch.Generator().manual_seed(0))
    return [r["completion"] for r in decoded.records]


def agreement(ar_answers: list[str], runs: dict, prompts: list[str], num_new: int, batch: int) -> dict:
    out: dict = {"prompts": len(prompts), "new_tokens": num_new, "metric": "ROUGE-L F1 and token F1 over words"}
    for name, (loaded, setts) in runs.items():
        theirs = answers(loaded, setts["fast"], prompts, num_new, batch)
        rl = [rouge_l(c, r) for c, r in zip(theirs, ar_answers, strict=True)]
        f1 = [token_f1(c, r) for c, r in zip(theirs, ar_answers, strict=True)]
        out[name] = {"setting": "fast", "rouge_l": round(statistics.mean(rl), 4),
                     "token_f1": round(statistics.mean(f1), 4),
                     "exact": sum(c.strip() == r.strip() for c, r in zip(theirs, ar_answers, strict=True)),
                     "example": {"prompt": prompts[0], "ar": ar_answers[0], name: theirs[0]}}  # fmt: skip
        progress(f"agreement {name}: {out[name]['rouge_l']} ROUGE-L, {out[name]['token_f1']} token F1")
    return out


# -- (s) speed ----------------------------------------------------------------------------------------------
def speed(ar, timed: dict, prompts: list[str], num_new: int, rounds: int, batches: list[int]) -> dict:
    from dllm.inference.engine import generate

    variants = {"ar": (ar, {"generation": "causal"})} | timed
    out: dict = {"prompts": len(prompts), "new_tokens": num_new, "rounds": rounds}
    for batch in batches:
        ready = {}
        for name, (loaded, fields) in variants.items():
            s = setup(loaded, fields, num_new)
            ids = [chat_encoder(loaded)(p) for p in prompts]
            ready[name] = (s, [ids[i : i + batch] for i in range(0, len(ids), batch)])
        walls: dict[str, list[float]] = {n: [] for n in ready}
        counts: dict[str, tuple[int, int]] = {}

        def run(name: str, ready: dict = ready, calls: int | None = None) -> tuple[int, int]:
            s, chunks = ready[name]
            tokens = nfe = 0
            for chunk in chunks[:calls]:
                res = generate(s.loaded.model, chunk, s.sampler, s.special, generator=torch.Generator().manual_seed(0))
                tokens += sum(len(q) for q in res.sequences)
                nfe += res.counters.nfe * len(chunk)
            return tokens, nfe

        for name in ready:  # warm-up: one call each (kernels, allocator), not a whole round
            run(name, calls=1)
        for r in range(rounds):
            order = list(ready)[r % len(ready) :] + list(ready)[: r % len(ready)]
            for name in order:
                t0 = time.perf_counter()
                counts[name] = run(name)
                walls[name].append(time.perf_counter() - t0)
            progress(f"speed batch {batch} round {r + 1}/{rounds}")
        row: dict = {}
        for name, (tokens, nfe) in counts.items():
            wall = statistics.median(walls[name])
            row[name] = {"tok_s": round(tokens / wall, 2), "forwards_per_token": round(nfe / max(tokens, 1), 3),
                         "answer_tokens": tokens}  # fmt: skip
        for name in timed:
            row[name]["speed_over_ar"] = round(row[name]["tok_s"] / row["ar"]["tok_s"], 3)
        out[f"batch_{batch}"] = row
    return out


# -- (c) confidence -----------------------------------------------------------------------------------------
def shares(values: list[float]) -> dict:
    """How many values, the share at or above each of CUTS, and the median."""
    if not values:
        return {"n": 0}
    out: dict = {"n": len(values)}
    out |= {f"p>={c:g}": round(sum(v >= c for v in values) / len(values), 3) for c in CUTS}
    return out | {"median": round(statistics.median(values), 3)}


class Recording:
    """A canvas loop's policy that also keeps, at each step, the top probability of the region's first
    undecided positions (batch 1), left to right."""

    def __init__(self, policy, depth: int = 4) -> None:
        self.policy, self.depth, self.steps = policy, depth, []

    def __getattr__(self, name: str):
        return getattr(self.policy, name)

    def step(self, prop, state):
        (undecided,) = state.eligible_BR[0].nonzero(as_tuple=True)
        self.steps.append(prop.prob_BR[0, undecided[: self.depth]].tolist())
        return self.policy.step(prop, state)


def ar_greedy(ar, prompts: list[str], num_new: int) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """The AR original's greedy answer to each prompt at batch 1 (KV cache): (prompt ids, answer ids, the
    answer's logits [n, V]); the confidence and ceiling sections read the same answers."""
    from dllm.inference.engine import generate

    s, out = setup(ar, {"generation": "causal"}, num_new), []
    for p in prompts:
        ids = chat_encoder(ar)(p)
        got = generate(ar.model, [ids], s.sampler, s.special, return_logits=True)
        answer = list(got.sequences[0])
        out.append((list(ids), answer, got.logits_BNV[0, : len(answer)]))
    return out


def confidence(ar_answers: list, timed: dict, prompts: list[str], num_new: int) -> dict:
    """`ar_answers`: `ar_greedy` of `prompts`."""
    from dllm.inference.engine import decode_alone
    from dllm.sampling.canvas_loop import Loop

    out: dict = {"prompts": len(prompts), "new_tokens": num_new}
    chosen = [v for _, _, logits in ar_answers for v in logits.float().softmax(-1).amax(-1).tolist()]
    out["ar"] = {"chosen_token": shares(chosen)}
    for name, (loaded, fields) in timed.items():
        s = setup(loaded, fields, num_new)
        tokens = forwards = 0
        recorded: list[list[float]] = []
        for p in prompts:
            loop = Loop(loaded.model, [chat_encoder(loaded)(p)], s.sampler, s.special, torch.Generator().manual_seed(0),
                        None, None)  # fmt: skip
            loop.policy = Recording(loop.policy)
            res = decode_alone(loaded.model, s.special, loop)
            tokens, forwards = tokens + len(res.sequences[0]), forwards + res.counters.nfe
            recorded += loop.policy.steps
        row = {"forwards_per_token": round(forwards / max(tokens, 1), 3), "steps": len(recorded)}
        row |= {f"position_{k + 1}": shares([r[k] for r in recorded if len(r) > k]) for k in range(4)}
        out[name] = row
        progress(f"confidence {name}: {row}")
    return out


# -- (k) ceiling --------------------------------------------------------------------------------------------
def after_paths(model, full, length: int, rows: list[tuple[int, list[int]]], chunk: int = 64):
    """For each row (j, path) (paths of one length): P(. | sequence[:j] + path), the AR original's next-token
    distribution after the first j tokens of the sequence `full` holds (its KV cache over `length` tokens) and
    the path's tokens. Yields (rows, probs [n, V]) per chunk of rows: each row gets a copy of the cache, cut
    at j (the causal mask of a row at length j sees only [0, j) and its own path)."""
    from dllm.sampling.causal import Target
    from dllm.sampling.results import Counters

    for i in range(0, len(rows), chunk):
        part = rows[i : i + chunk]
        q = len(part[0][1])
        target = Target(model, len(part), length + q, Counters())
        target.cache.put(list(range(len(part))), full.cache, length, len(part))
        target.length_B = torch.tensor([j for j, _ in part])
        logits, _ = target.forward(torch.tensor([path for _, path in part]), torch.full((len(part), 1), q - 1))
        yield part, logits[:, 0].float().softmax(-1)


def lookahead(model, sequence: list[int], start: int, top: int, chunk: int = 64) -> list[dict]:
    """Along a greedy answer (sequence[start:], after its prompt), at each decided prefix sequence[:j]: how
    sure a model that knows exactly the AR original's next-token distributions could be of the 2nd and 3rd
    undecided positions (j + 1, j + 2) without their left neighbours: the top probability of their marginal,
    P(y | s) = sum over paths x of P(x | s) P(y | s, x), with the paths x the `top` most likely (for the 3rd,
    the `top` most likely pairs among the `top` 1st tokens x their `top` 2nd ones). Per j: `lo` that top
    probability over the paths counted, `hi` = lo + the probability of the paths left out (so the true top
    probability lies in [lo, hi]), and `greedy` whether its argmax is the AR original's own next token there."""
    from dllm.sampling.causal import Target
    from dllm.sampling.results import Counters

    n = len(sequence)
    full = Target(model, 1, n + 2, Counters())
    logits, _ = full.forward(torch.tensor([sequence]))
    full.commit(torch.tensor([n]))
    p1_LV = logits[0].float().softmax(-1)  # p1_LV[i] = P(. | sequence[: i + 1])
    js = list(range(start, n - 1))  # the 2nd position (index j + 1) is an answer token
    first = {j: p1_LV[j - 1].topk(top) for j in js}
    marg2 = {j: torch.zeros_like(p1_LV[0]) for j in js}
    pairs: dict[int, list[tuple[float, tuple[int, int]]]] = {j: [] for j in js}  # (P(x1, x2 | s), (x1, x2))
    rows2 = [(j, [x]) for j in js for x in first[j].indices.tolist()]
    for part, probs in after_paths(model, full, n, rows2, chunk):
        for (j, (x,)), p in zip(part, probs, strict=True):
            px = float(p1_LV[j - 1, x])
            marg2[j] += px * p
            best = p.topk(top)
            pairs[j] += [(px * v, (x, y)) for v, y in zip(best.values.tolist(), best.indices.tolist(), strict=True)]
    kept = {j: sorted(pairs[j], reverse=True)[:top] for j in js if j + 2 < n}  # the 3rd position is one too
    marg3 = {j: torch.zeros_like(p1_LV[0]) for j in kept}
    weight = {(j, path): w for j, paths in kept.items() for w, path in paths}
    rows3 = [(j, list(path)) for j, paths in kept.items() for _, path in paths]
    for part, probs in after_paths(model, full, n, rows3, chunk):
        for (j, path), p in zip(part, probs, strict=True):
            marg3[j] += weight[(j, tuple(path))] * p
    out: list[dict] = []
    for j in js:
        top2 = float(marg2[j].max())
        row = {"j": j, "lo2": top2, "hi2": top2 + 1 - float(first[j].values.sum()),
               "greedy2": int(marg2[j].argmax()) == sequence[j + 1]}  # fmt: skip
        if j in kept:
            top3 = float(marg3[j].max())
            row |= {"lo3": top3, "hi3": top3 + 1 - sum(w for w, _ in kept[j]),
                    "greedy3": int(marg3[j].argmax()) == sequence[j + 2]}  # fmt: skip
        out.append(row)
    return out


def ceiling(ar, ar_answers: list, num_new: int, top: int) -> dict:
    """The 2nd and 3rd positions' confidence of a model that knows what the AR original knows (`lookahead`),
    along the AR original's greedy answers (`ar_greedy`); the forwards per token of a threshold decode that
    commits the 2nd and 3rd positions (contiguously, after the 1st) wherever that confidence's upper bound
    passes; and the tau of a parallel drafter whose 3 drafts a round are those marginals' argmax (kept while
    they are the greedy tokens)."""
    answers: list[tuple[int, dict[int, dict]]] = []  # per prompt: its answer's length, its rows by j - start
    for ids, answer, _ in ar_answers:
        rows = lookahead(ar.model, ids + answer, len(ids), top) if len(answer) >= 2 else []
        answers.append((len(answer), {r["j"] - len(ids): r for r in rows}))
    steps = [r for _, rows in answers for r in rows.values()]
    tokens = sum(n for n, _ in answers)
    out: dict = {"prompts": len(ar_answers), "new_tokens": num_new, "top": top, "answer_tokens": tokens}

    def forwards(advance) -> int:
        """Forwards along every answer when the one at answer index i moves on by advance(its row) tokens."""
        count = 0
        for n, rows in answers:
            i = 0
            while i < n:
                count, i = count + 1, i + advance(rows.get(i, {}))
        return count

    for k in (2, 3):
        have = [r for r in steps if f"lo{k}" in r]
        greedy = sum(r[f"greedy{k}"] for r in have) / max(len(have), 1)
        out[f"position_{k}"] = {"bound_lo": shares([r[f"lo{k}"] for r in have]),
                                "bound_hi": shares([min(r[f"hi{k}"], 1.0) for r in have]),
                                "argmax_is_greedy": round(greedy, 3)}  # fmt: skip
    for cut in CUTS:  # the 1st position, then the 2nd and the 3rd while sure
        sure = forwards(lambda r, c=cut: 1 + (r.get("hi2", 0.0) >= c) * (1 + (r.get("hi3", 0.0) >= c)))
        out[f"oracle_forwards_per_token_at_{cut:g}"] = round(sure / max(tokens, 1), 3)
    # the drafts kept (the 1st, the greedy token, always), then the target's own token
    drafted = forwards(lambda r: 2 + bool(r.get("greedy2")) + bool(r.get("greedy2") and r.get("greedy3")))
    out["parallel_drafter_tau_3_drafts"] = round(tokens / max(drafted, 1), 3)
    progress(f"ceiling: {out}")
    return out


# -- (l) likelihood -----------------------------------------------------------------------------------------
def prepare_responses(ar, prompts: list[str], responses: list[str], folder: Path) -> Path:
    """The held-out exchanges as an artifact, prepared as the recipes prepare theirs (chat turns)."""
    turn = [{"role": "user", "content": p} for p in prompts]
    records = [{"chat": {"prompt": [u], "completion": [{"role": "assistant", "content": r}]}}
               for u, r in zip(turn, responses, strict=True)]  # fmt: skip
    (folder / "responses.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = {"tokenizer": {"kind": "hf", "path": str(ar.source)}, "output": "prepared", "seq_len": 192,
              "layout": "indexed", "append_eos": False,
              "sources": [{"path": "responses.jsonl", "format": "prompt_completion", "prompt_field": "chat.prompt",
                           "completion_field": "chat.completion"}]}  # fmt: skip
    (folder / "prepare.json").write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "dllm.cli.main", "data", "prepare", "--config", str(folder / "prepare.json")]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return folder / "prepared"


def likelihood(ar, runs: dict, prompts: list[str], responses: list[str], samples: int, batch: int) -> dict:
    from dllm.data.artifact import validate_artifact
    from dllm.evaluation.likelihood import score_artifact, scoring_for, summarize

    with tempfile.TemporaryDirectory() as tmp:
        artifact = validate_artifact(prepare_responses(ar, prompts, responses, Path(tmp)), checksums=True)
        out: dict = {"rows": artifact.num_sequences, "what": "the AR original's greedy answers to held-out prompts"}
        for name, loaded in [("ar", ar)] + [(n, ld) for n, (ld, _) in runs.items()]:
            how = scoring_for(loaded, "ar" if name == "ar" else "auto")
            k = 1 if how.kind == "ar" else samples
            parts = score_artifact(loaded.model, artifact, how, None, batch, k, True, 0, torch.device("cpu"))
            summary = summarize(parts, exact=how.kind == "ar").as_dict()
            out[name] = {
                "kind": how.kind,
                **{key: round(v, 4) if isinstance(v, float) else v for key, v in summary.items()},
            }
            progress(f"likelihood {name}: {out[name]['nelbo_per_token']} nats/token")
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="append", default=[], help="NAME=RUN_DIR of a converted model (repeat)")
    parser.add_argument("--ar-model", type=Path, help="the AR original's folder (default: the cached import)")
    parser.add_argument("--model", choices=["full", "trunc"], default="full", help="the cached import to use")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=int, default=1000, help="eval items per task (each table's split holds fewer)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--open-prompts", type=int, default=100)
    parser.add_argument("--open-new", type=int, default=128)
    parser.add_argument("--speed-prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--likelihood-rows", type=int, default=200)
    parser.add_argument("--mc-samples", type=int, default=8)
    parser.add_argument("--ceiling-top", type=int, default=16, help="ceiling: the 1st tokens (pairs) summed over")
    parser.add_argument("--sections", default=",".join(SECTIONS))
    parser.add_argument(
        "--threshold-sweep",
        type=float,
        nargs="*",
        default=[],
        help="accuracy: the fast setting at these thresholds too (settings threshold_<t>)",
    )
    parser.add_argument(
        "--settings",
        help="the settings to score (accuracy) and time (speed, confidence: the "
        "threshold ones), comma-separated (default: all; timed: fast)",
    )
    parser.add_argument("--allow-overlap", action="store_true", help="go on when an item is in a run's training data")
    args = parser.parse_args(argv)
    from dllm.checkpoint.loading import load_for_inference
    from dllm.evaluation.tasks import load_task

    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        raise SystemExit(f"bench/real_a2d.py: --sections: unknown {sorted(sections - set(SECTIONS))}")
    if args.ar_model is None and rm.missing() is not None:
        raise SystemExit(f"bench/real_a2d.py: {rm.missing()}")
    load_before = os.getloadavg()
    ar = load_for_inference(model_dir=args.ar_model or rm.converted(args.model))
    runs = {}
    for item in args.run:
        name, _, path = item.partition("=")
        loaded = load_for_inference(run=Path(path))
        runs[name] = (loaded, settings(loaded.profile, tuple(args.threshold_sweep)))
        if args.settings and (unknown := set(args.settings.split(",")) - set(runs[name][1])):
            raise SystemExit(f"bench/real_a2d.py: --settings: unknown {sorted(unknown)} (have {sorted(runs[name][1])})")
    tasks = [load_task(t, args.limit) for t in args.tasks.split(",") if t]
    n_open = max(args.open_prompts, args.likelihood_rows if "likelihood" in sections else 0)
    open_prompts = rm.instructions(n_open)  # the held-out split: topics no training prompt names
    result: dict = {"bench": "real_a2d", "ar": str(ar.source),
                    "runs": {n: str(ld.source) for n, (ld, _) in runs.items()},
                    "settings": {n: st for n, (_, st) in runs.items()}, "threads": torch.get_num_threads(),
                    "torch": torch.__version__}  # fmt: skip
    t0 = time.perf_counter()
    with torch.inference_mode():
        if "overlap" in sections:
            result["overlap"] = overlap(runs, tasks, open_prompts)
            seen = {n: {k: v for k, v in o.items() if v and k != "items_checked"} for n, o in result["overlap"].items()}
            if any(seen.values()) and not args.allow_overlap:
                raise SystemExit(f"bench/real_a2d.py: items found in a run's training data: {seen}")
        if "accuracy" in sections:
            result["accuracy"] = accuracy(ar, runs, tasks, args.batch_size, args.settings)
        if sections & {"agreement", "likelihood"}:
            ar_answers = answers(ar, {"generation": "causal"}, open_prompts, args.open_new, args.batch_size)
        if "agreement" in sections:
            prompts = open_prompts[: args.open_prompts]
            result["agreement"] = agreement(ar_answers[: len(prompts)], runs, prompts, args.open_new, args.batch_size)
        timed, prompts = timed_settings(runs, args.settings), open_prompts[: args.speed_prompts]
        if "speed" in sections:
            result["speed"] = speed(ar, timed, prompts, args.open_new, args.rounds, args.batches)
        if sections & {"confidence", "ceiling"}:
            greedy = ar_greedy(ar, prompts, args.open_new)
        if "confidence" in sections:
            result["confidence"] = confidence(greedy, timed, prompts, args.open_new)
        if "ceiling" in sections:
            result["ceiling"] = ceiling(ar, greedy, args.open_new, args.ceiling_top)
    if "likelihood" in sections:  # score_artifact runs its own no-grad forwards
        rows = args.likelihood_rows
        with torch.no_grad():
            result["likelihood"] = likelihood(ar, runs, open_prompts[:rows], ar_answers[:rows], args.mc_samples,
                                              args.batch_size)  # fmt: skip
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    result["load_average_before"] = [round(x, 2) for x in load_before]
    result["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
