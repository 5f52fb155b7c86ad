"""lm-evaluation-harness adapter: `--model dllm` scores and samples a dllm run in any lm_eval task.

- loglikelihood: minus the mean of K Monte Carlo samples of the negative ELBO of the continuation
  given the context (likelihood.nelbo_samples): an unbiased estimate of a lower bound on
  log p(continuation | context) for masked and block diffusion models, the exact log-probability for
  kind=ar (K = 1; each distinct context computed once, evaluation/shared_context.py). With cfg_scale > 0
  it is a guided score (LLaDA's evaluation), not a bound. `mc_stderr` keeps each request's Monte Carlo
  standard error (the K samples' standard deviation / sqrt(K); 0 when exact). The continuation's tokens
  are the whole text's after the context's, as lm_eval's causal models split them.
  is_greedy: one forward with the whole continuation masked (context clean) predicts, by argmax, the
  target at every continuation position (for ar: the teacher-forced argmax). A masked model decodes
  over several steps, so this "all at once" test is stricter than greedy decoding; it is the
  single-forward analogue of lm_eval's causal check and costs one forward per batch.
  suffix_masks=N appends N mask tokens after the continuation that are never scored: a bidirectional
  model sees the length of its canvas, so without them it scores the continuation as the *end* of the
  text; with them, as a prefix of N + |continuation| unknown tokens, as in generation (a model trained
  on EOS-padded documents, as `dllm init` prepares them, needs this to rank answers; see the tests).
- loglikelihood_rolling: the whole text (after a BOS / EOS prefix), in lm_eval's rolling windows of
  max_length tokens (the model's max_seq_len by default); the sum of the windows' bounds.
  Rows longer than max_length are truncated from the left (for loglikelihood and generation prompts).
- generate_until: sampling.generate, gen_length = max_gen_toks rounded up to the block length in
  effect (the output is cut back to max_gen_toks tokens), stop strings = `until`, stop at EOS.

Use (lm_eval 0.4.13's `lm_eval` script cannot find plug-in models, so run its CLI through this module,
or `dllm eval harness ...` with the same arguments):
    python -m dllm.evaluation.harness --model dllm --model_args run=RUN,mc_samples=32 --tasks TASK
model_args win over lm_eval's own --batch_size and --device (its CLI passes 1 and cuda:0 by default).
or in Python: `from dllm.evaluation.harness import DllmLM` and `lm_eval.simple_evaluate(model=DllmLM(run=...))`
(or model="dllm" once this module is imported).

Shapes: B batch, L sequence, K samples, N selected positions.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

try:
    import lm_eval.models  # noqa: F401  (lm_eval's own lazy entries; get_model adds them only to an empty registry)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import model_registry, register_model
except ImportError as err:  # an optional extra
    raise ImportError(
        f"dllm.evaluation.harness needs lm-evaluation-harness ({err}); install it with: pip install 'dllm[eval]'"
    ) from err

import torch

from dllm.checkpoint.loading import load_for_inference
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.errors import ConfigError, UserError
from dllm.evaluation.harness_args import (
    merge_lm_eval_config,
    optional_path,
    parse_arg_string,
    parse_device,
    parse_model_args,
)
from dllm.evaluation.likelihood import ScoringModel, guided_hidden, nelbo_samples, predictor_hidden, scoring_for
from dllm.evaluation.shared_context import score_shared_contexts
from dllm.inference.engine import generate
from dllm.models.families.base import is_causal_model
from dllm.sampling.canvas import SpecialIds
from dllm.sampling.stops import cut_at_stop, stop_function

DEFAULT_MAX_GEN_TOKS = 64
LM_EVAL_GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p")


def _batches(items: Sequence[int], size: int) -> Iterator[list[int]]:
    for lo in range(0, len(items), size):
        yield list(items[lo : lo + size])


@register_model("dllm")
class DllmLM(LM):
    """A dllm run (or model folder) as an lm_eval model; see the module docstring for what each request returns."""

    def __init__(self, **model_args: Any) -> None:
        super().__init__()
        model_args.pop("max_batch_size", None)  # lm_eval's auto batch sizing: not used here
        self.args, sampler, self._gen_length_set = parse_model_args(model_args)
        a = self.args
        if sum(x is not None for x in (a.run, a.checkpoint, a.model)) != 1:
            raise ConfigError("model_args: give exactly one of run=RUN_DIR, checkpoint=CHECKPOINT_DIR or model=DIR")
        self._device = parse_device(a.device)
        self.loaded = load_for_inference(
            optional_path(a.run), optional_path(a.checkpoint), self._device, model_dir=optional_path(a.model)
        )
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.mc_stderr: dict[tuple, float] = {}
        """Monte Carlo standard error of each log-likelihood request's estimate, by its arguments (0: exact)."""
        try:
            self._scoring: ScoringModel | ConfigError = scoring_for(self.loaded, a.kind)
        except ConfigError as e:  # no likelihood for this model (uniform-state, DiffusionGemma): it still generates
            if a.kind != "auto":  # a likelihood was asked for by name: refused now
                raise
            self._scoring = e
        scoring = None if isinstance(self._scoring, ConfigError) else self._scoring
        if sampler.generation == "auto" and is_causal_model(self.loaded.profile, self.loaded.model_cfg):
            sampler = sampler.model_copy(update={"generation": "causal"})  # generate_until decodes it causally
        self.sampler = resolve_sampler(sampler, self.loaded.profile)
        self.cfg_scale = self.sampler.cfg_scale
        self.seed = self.sampler.seed
        tok = self.tokenizer
        self.special = SpecialIds.of(self.loaded.profile)
        self.prefix_id = tok.bos_id if tok.bos_id is not None else tok.eos_id
        self.max_length = int(a.max_length or self.loaded.model_cfg.max_seq_len)
        if self.max_length > self.loaded.model_cfg.max_seq_len:
            raise ConfigError(f"model_args max_length: {self.max_length} exceeds the model's max_seq_len "
                              f"{self.loaded.model_cfg.max_seq_len}")  # fmt: skip
        bs = scoring.block_size if scoring is not None and scoring.kind == "block" else None
        self.window = self.max_length // bs * bs if bs else self.max_length  # rows padded to whole blocks
        is_ar = scoring is not None and scoring.kind == "ar"
        self.suffix = 0 if is_ar else a.suffix_masks
        if "suffix_masks" in a.model_fields_set and a.suffix_masks and is_ar:
            warnings.warn("model_args suffix_masks: an ar score never sees later tokens; ignored", stacklevel=2)
        if self.window - self.suffix < 2:
            raise ConfigError(f"model_args suffix_masks: {self.suffix} masks leave no room for a context and a "
                              f"continuation in max_seq_len {self.max_length}")  # fmt: skip

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DllmLM:
        return cls(**merge_lm_eval_config(parse_arg_string(arg_string), additional_config))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> DllmLM:
        return cls(**merge_lm_eval_config(dict(arg_dict), additional_config))

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.identity().get("vocab_hash", self.tokenizer.kind))

    @property
    def scoring(self) -> ScoringModel:
        """How this model is scored; a model without a likelihood here refuses the log-likelihood requests."""
        if isinstance(self._scoring, ConfigError):
            raise self._scoring
        return self._scoring

    # -- likelihood -------------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        rows = [self._fit(*self._encode_pair(*req.args), self.suffix) for req in requests]
        results = []
        for req, (ll, greedy, stderr) in zip(requests, self._score(rows), strict=True):
            self.mc_stderr[tuple(req.args)] = stderr
            results.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", req.args, results[-1])
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        rows, owner = [], []
        for i, req in enumerate(requests):
            # lm_eval's windows: every token scored once, with as much context as fits (here: `window`
            # tokens in all, so the windows hold window - 1 predictions after one context token)
            windows = get_rolling_token_windows(self.tokenizer.encode(req.args[0]), self.prefix_id, self.window - 1, 1)
            for ctx, cont in map(make_disjoint_window, windows):
                rows.append(self._fit(ctx, cont, 0))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _, _) in zip(owner, self._score(rows), strict=True):
            totals[i] += ll
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of (context, continuation) as lm_eval's causal models take them: the context's trailing
        spaces go to the continuation, the continuation is the whole text's ids after the context's (so a
        token across the boundary is tokenized as in the whole text); an empty context is the BOS (or EOS)."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return [self.prefix_id], self.tokenizer.encode(continuation)
        ctx = self.tokenizer.encode(context)
        return ctx, self.tokenizer.encode(context + continuation)[len(ctx) :]

    def _fit(self, ctx: list[int], cont: list[int], suffix: int) -> tuple[list[int], int, int]:
        """(row ids, start, end of the scored span): context + continuation truncated from the left to
        the model's window, then `suffix` unscored mask tokens."""
        ids = (ctx + cont)[-(self.window - suffix) :]
        n = min(len(cont), len(ids))
        if self.scoring.kind == "ar" and n == len(ids):  # the first token of a row has no predictor
            n -= 1
        return ids + [self.tokenizer.mask_id] * suffix, len(ids) - n, len(ids)

    def _score(self, rows: list[tuple[list[int], int, int]]) -> list[tuple[float, bool, float]]:
        """(bound on log p(scored span | the rest), is_greedy, its Monte Carlo standard error) per row, in the
        given order; exact for ar (each distinct context computed once: evaluation/shared_context.py)."""
        how = self.scoring
        if self.cfg_scale > 0 and how.kind != "mdlm":
            raise ConfigError(f"cfg_scale: guided likelihoods are computed for masked (mdlm) models; this one is "
                              f"scored as {how.kind} (use cfg_scale=0 for likelihood tasks)")  # fmt: skip
        out: list[tuple[float, bool, float]] = [(0.0, True, 0.0)] * len(rows)
        todo = sorted((i for i, (_, lo, hi) in enumerate(rows) if hi > lo), key=lambda i: -len(rows[i][0]))
        if how.kind == "ar":
            pairs = [(rows[i][0][: rows[i][1]], rows[i][0][rows[i][1] : rows[i][2]]) for i in todo]
            scores = score_shared_contexts(self.model, pairs, self.args.batch_size, how.mask_id)
            for i, (ll, greedy) in zip(todo, scores, strict=True):
                out[i] = (ll, greedy, 0.0)
            return out
        generator = torch.Generator().manual_seed(self.seed)  # the same requests give the same scores
        K = self.args.mc_samples
        for chunk in _batches(todo, self.args.batch_size):
            tokens, scored, valid = self._pad([rows[i] for i in chunk])
            res = nelbo_samples(self.model, tokens, scored, how, num_samples=K, antithetic=self.args.antithetic,
                                generator=generator, valid_BL=valid, cfg_scale=self.cfg_scale)  # fmt: skip
            ll_B = -res.samples_BK.mean(1)
            se_B = res.samples_BK.std(1) / math.sqrt(K) if K > 1 else torch.zeros_like(ll_B)
            greedy_B = self._greedy(tokens, scored, valid)
            for j, i in enumerate(chunk):
                out[i] = (float(ll_B[j]), bool(greedy_B[j]), float(se_B[j]))
        return out

    def _pad(self, rows: list[tuple[list[int], int, int]]):
        """Right-padded tokens, scored and valid [B, L]; L a multiple of the block size for block models."""
        L = max(len(ids) for ids, _, _ in rows)
        if self.scoring.kind == "block":
            bs = self.scoring.block_size or 1
            L = -(-L // bs) * bs
        tokens = torch.full((len(rows), L), self.tokenizer.pad_id, dtype=torch.long)
        scored = torch.zeros((len(rows), L), dtype=torch.bool)
        valid = torch.zeros_like(scored)
        for b, (ids, lo, hi) in enumerate(rows):
            tokens[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            valid[b, : len(ids)] = True
            scored[b, lo:hi] = True
        return tokens.to(self._device), scored.to(self._device), valid.to(self._device)

    def _greedy(self, tokens_BL, scored_BL, valid_BL):
        """[B] bool: the argmax of one forward (continuation masked; for ar teacher-forced) is the target
        at every scored position (with guidance when cfg_scale > 0, as the score)."""
        how, model = self.scoring, self.model
        docs = None if bool(valid_BL.all()) else (~valid_BL).long()
        noisy = torch.where(scored_BL, how.mask_id, tokens_BL)
        with torch.no_grad():
            hidden, has = predictor_hidden(model, tokens_BL, noisy, how, docs)
            selected = scored_BL & has
            logits = model.logits(hidden[selected]).double()
            if how.kind == "mdlm" and self.cfg_scale > 0:  # the same guidance as the score: context masked
                _, unc_hidden, _ = guided_hidden(model, tokens_BL, noisy, scored_BL, how, docs, self.cfg_scale)
                unc = model.logits(unc_hidden[selected]).double()
                logits = unc + (1 + self.cfg_scale) * (logits - unc)
        logits[:, how.mask_id] = float("-inf")
        wrong = (logits.argmax(-1) != tokens_BL[selected]).long()
        rows_N = selected.nonzero()[:, 0]
        B = tokens_BL.shape[0]
        return torch.zeros(B, dtype=torch.long, device=wrong.device).index_add_(0, rows_N, wrong).cpu() == 0

    # -- generation --------------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for idxs in groups.values():
            cfg, max_new = self._gen_config(requests[idxs[0]].args[1])
            stops = list(cfg.stop_strings)
            stop = stop_function(self.tokenizer, stops)
            generator = torch.Generator(device=self._device).manual_seed(cfg.seed)
            for chunk in _batches(idxs, self.args.batch_size):
                prompts = [self._prompt(requests[i].args[0], cfg.gen_length) for i in chunk]
                res = generate(self.model, prompts, cfg, self.special, generator=generator, stop=stop)
                for i, ids in zip(chunk, res.sequences, strict=True):
                    out[i] = cut_at_stop(self.tokenizer.decode(ids[:max_new]), stops)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _gen_config(self, gen_kwargs: dict[str, Any]) -> tuple[SamplerConfig, int]:
        """The sampler for one set of lm_eval gen_kwargs, and max_gen_toks."""
        kw = dict(gen_kwargs or {})
        ignored = sorted(set(kw) - set(LM_EVAL_GEN_KWARGS))
        if ignored:
            warnings.warn(f"gen_kwargs {', '.join(ignored)}: not used by the dllm sampler", stacklevel=3)
        until = kw.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        default = self.sampler.gen_length if self._gen_length_set else DEFAULT_MAX_GEN_TOKS
        max_new = int(kw.get("max_gen_toks") or default)
        block = self.sampler.block_length
        G = -(-max_new // block) * block if block else max_new
        update: dict[str, Any] = {"gen_length": G, "stop_at_eos": True}
        update["stop_strings"] = list(dict.fromkeys([*until, *self.sampler.stop_strings]))
        if self.sampler.steps is not None:  # the same tokens per step as the configured sampler
            blocks = G // (block or G)
            steps = math.ceil(self.sampler.steps * G / self.sampler.gen_length / blocks) * blocks
            update["steps"] = min(steps, G)
        if kw.get("temperature") is not None:
            update["temperature"] = float(kw["temperature"])
        if kw.get("do_sample") is False:
            update["temperature"] = 0.0
        elif kw.get("do_sample") and not update.get("temperature", self.sampler.temperature):
            update["temperature"] = 1.0
        for k in ("top_k", "top_p"):
            if kw.get(k) is not None:
                update[k] = kw[k]
        cfg = self.sampler.model_copy(update=update)
        return resolve_sampler(cfg, self.loaded.profile), max_new

    def _prompt(self, context: str, gen_length: int) -> list[int]:
        """The context's ids, truncated from the left so that prompt + generation fit max_seq_len."""
        budget = self.max_length - gen_length
        if budget < 1:
            raise ConfigError(f"max_gen_toks: {gen_length} generated tokens leave no room for a prompt in "
                              f"the model's max_seq_len {self.max_length}")  # fmt: skip
        ids = self.tokenizer.encode(context) or [self.prefix_id]
        return ids[-budget:]


def main(argv: list[str] | None = None, execute: Callable[[Any], None] | None = None) -> int:
    """lm_eval's own CLI with `--model dllm` registered: `python -m dllm.evaluation.harness --model dllm ...`.
    A dllm user error, and lm_eval's refusal of its arguments (usage, --model_args, an unknown task), end in
    one line `dllm: error: ...` and exit code 2; --model_args of dllm are checked before lm_eval loads tasks.
    `execute`: what runs the parsed arguments (lm_eval's own command by default; evaluation/benchmarks.py
    runs them on packaged data)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    if "dllm" not in model_registry:
        register_model("dllm")(DllmLM)
    saved = sys.argv
    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]  # lm_eval's parser reads sys.argv
    try:
        setup_logging()
        cli = HarnessCLI()
        args = _lm_eval_refusals(lambda: _parse_quietly(cli))
        if getattr(args, "model", None) == "dllm":
            values = dict(getattr(args, "model_args", None) or {})
            values.pop("max_batch_size", None)  # as DllmLM takes them
            parse_model_args(values)
        _lm_eval_refusals(lambda: (execute or cli.execute)(args))
    except UserError as e:
        print(f"dllm: error: {' '.join(str(e).split())}", file=sys.stderr)
        return e.exit_code
    finally:
        sys.argv = saved
    return 0


_ARGUMENT_MODULES = ("lm_eval._cli", "lm_eval.config")
"""lm_eval's modules that read its command line and check it (EvaluatorConfig, the task lookup)."""


def _lm_eval_refusals(step: Callable[[], Any]) -> Any:
    """Run `step`; an error that lm_eval raises while it reads and checks its arguments (in _ARGUMENT_MODULES: a
    bad --model_args, an unknown task) is the user's, one ConfigError. Errors of the evaluation stay errors."""
    try:
        return step()
    except (ValueError, TypeError, KeyError, OSError) as e:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        if tb is None or not str(tb.tb_frame.f_globals.get("__name__", "")).startswith(_ARGUMENT_MODULES):
            raise
        raise ConfigError(f"lm_eval refuses its arguments: {' '.join(str(e).split())[:300]}") from None


def _parse_quietly(cli: Any) -> Any:
    """lm_eval's parse of sys.argv; a usage error (argparse prints the usage, then its error, and exits 2)
    becomes one ConfigError with argparse's last line. --help still prints and exits."""
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            return cli.parse_args()
    except SystemExit as e:
        if e.code in (0, None):
            sys.stderr.write(printed.getvalue())
            raise
        last = (printed.getvalue().strip().splitlines() or ["invalid arguments"])[-1]
        raise ConfigError(f"lm_eval refuses its arguments: {last}") from None


if __name__ == "__main__":
    sys.exit(main())
