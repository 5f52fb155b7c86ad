"""Likelihood bounds: Monte Carlo estimates of the negative ELBO of masked and block diffusion models,
and the exact negative log-likelihood of causal (autoregressive) models, on the same token rows.

For a masked diffusion model with schedule alpha(t) the continuous-time bound on the scored tokens x
(a prompt is context: never masked, never scored) is (MDLM, Sahoo et al. 2024; Shi et al. 2024)

    -log p(x) <= NELBO(x) = E_{t ~ U(0, 1]} [ w(t) * sum_{i masked at t} -log p(x_i | x_t) ],

w(t) = -alpha'(t) / (1 - alpha(t)) (1/t for the linear schedule), each scored token masked with
probability 1 - alpha(t). A block diffusion model's bound is the sum over blocks of that bound for
the block given the clean blocks before it (BD3LM, Arriola et al. 2025), estimated in the 2L layout
[x_t ; x_0] with one t per block. K Monte Carlo samples per row (and block): `plain` draws t and
the masks independently; `stratified` (antithetic) spaces the K samples evenly, over the number of
masked tokens for the linear schedule (the discrete form of the same bound, see `_corrupt`) or over
t otherwise: the same expectation, a lower variance at equal cost.

Shapes: B batch, L sequence, K samples, E hidden, N selected positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.registries import SCHEDULES
from dllm.diffusion.objectives.block import shifted_rows, two_halves
from dllm.models.chunked_ce import linear_cross_entropy

Kind = Literal["mdlm", "block", "ar"]


@dataclass(frozen=True)
class ScoringModel:
    """How to score a model: what it is, and the ids it needs."""

    kind: Kind
    mask_id: int
    block_size: int | None = None
    """Block models: the training block size."""
    shift: bool = False
    """Position i predicted from the state at i-1: block models trained with the token shift (Fast-dLLM v2,
    bd3lm shift), masked models with model.shift_logits (Dream, a2d-smollm2-mdlm)."""
    causal_context: bool = False
    """Block models whose clean half was trained token-causally (nemotron_diffusion)."""
    schedule: str = "linear"


@dataclass
class NelboSamples:
    """Per-row Monte Carlo samples of the bound (nats, summed over the row's scored tokens)."""

    samples_BK: torch.Tensor
    """float64 [B, K]; for an AR model K = 1 and the value is the exact NLL."""
    tokens_B: torch.Tensor
    """Scored tokens per row."""
    forward_passes: int


def time_samples(u_B: torch.Tensor, num_samples: int, antithetic: bool, generator: torch.Generator | None):
    """[B, K] times in (0, 1]: evenly spaced from a per-row offset (antithetic) or independent."""
    B = u_B.shape[0]
    if antithetic:
        k = torch.arange(num_samples, dtype=torch.float64)[None, :] / num_samples
        u_BK = torch.remainder(u_B.double()[:, None] + k, 1.0)
    else:
        u_BK = torch.rand(B, num_samples, generator=generator, dtype=torch.float64)
    return 1.0 - u_BK  # u in [0, 1) -> t in (0, 1]


@torch.no_grad()
def nelbo_samples(
    model: torch.nn.Module,
    tokens_BL: torch.Tensor,
    scored_BL: torch.Tensor,
    how: ScoringModel,
    *,
    num_samples: int,
    antithetic: bool = True,
    generator: torch.Generator | None = None,
    valid_BL: torch.Tensor | None = None,
    cfg_scale: float = 0.0,
) -> NelboSamples:
    """K samples of the bound per row. `scored_BL`: the tokens whose likelihood is bounded (the rest
    is context, never masked). `valid_BL`: False at padding (a separate document for attention).
    `cfg_scale` > 0 (masked models): classifier-free guidance on the predictions, the context masked
    in the unconditional pass (as LLaDA evaluates); the result is then a guided score, not a bound."""
    device = tokens_BL.device
    B, L = tokens_BL.shape
    scored = scored_BL.to(device).bool()
    docs = None if valid_BL is None or bool(valid_BL.all()) else (~valid_BL.to(device)).long()
    if cfg_scale > 0 and how.kind != "mdlm":
        raise ValueError(f"cfg_scale: guidance is applied to masked (mdlm) scoring only, not {how.kind}")
    if how.kind == "ar":  # exact: one pass; a row's first token has no left context and is not scored
        hidden, has = predictor_hidden(model, tokens_BL, tokens_BL, how, docs)
        nll_B = _row_ce(model, hidden, scored & has, tokens_BL, None)
        return NelboSamples(nll_B[:, None], (scored & has).sum(-1).cpu(), 1)
    schedule = SCHEDULES.resolve(how.schedule)()
    gen_device = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,), generator=generator)))
    out = torch.zeros(B, num_samples, dtype=torch.float64)
    passes = 0
    if how.kind == "mdlm":
        u_B = torch.rand(B, generator=gen_device, dtype=torch.float64)
        for k in range(num_samples):
            masked, w_B = _corrupt(scored, u_B, k, num_samples, antithetic, schedule, how.schedule, gen_device)
            noisy = torch.where(masked, how.mask_id, tokens_BL)
            hidden = guided_hidden(model, tokens_BL, noisy, scored, how, docs, cfg_scale)
            out[:, k] = _row_ce(model, hidden, masked, tokens_BL, how.mask_id) * w_B.cpu()
            passes += 1
        return NelboSamples(out, scored.sum(-1).cpu(), passes)
    assert how.kind == "block" and how.block_size is not None
    bs = how.block_size
    if L % bs:
        raise ValueError(f"block likelihood: length {L} is not a multiple of block_size {bs}")
    nb = L // bs
    if how.shift:  # position 0 has no predictor in a shifted model: it is not scored
        scored = scored & (torch.arange(L, device=device) > 0)[None, :]
    u_G = torch.rand(B * nb, generator=gen_device, dtype=torch.float64)
    for k in range(num_samples):
        masked_G, w_G = _corrupt(scored.reshape(B * nb, bs), u_G, k, num_samples, antithetic, schedule, how.schedule,
                                 gen_device)  # fmt: skip
        masked = masked_G.reshape(B, L)
        w_BL = w_G.reshape(B, nb).repeat_interleave(bs, dim=1).to(device)
        noisy = torch.where(masked, how.mask_id, tokens_BL)
        hidden, _ = predictor_hidden(model, tokens_BL, noisy, how, docs)
        out[:, k] = _row_ce(model, hidden, masked, tokens_BL, how.mask_id, w_BL)
        passes += 1
    return NelboSamples(out, scored.sum(-1).cpu(), passes)


def _corrupt(scored_GN, u_G, k: int, K: int, stratified: bool, schedule, schedule_name: str, gen):
    """Which scored positions of each group (a row, or a block) are masked in sample k of K, and the
    weight of each masked token's cross-entropy.

    plain: t ~ U(0, 1] independently, each token masked with probability 1 - alpha(t), weight w(t).
    stratified, linear schedule: the same bound in its discrete form (for alpha(t) = 1 - t the
    continuous NELBO equals E over l ~ U{1..n} of (n / l) * the CE of l uniformly chosen masked
    tokens): the K samples take evenly spaced counts l_k = 1 + floor(frac(u + k / K) * n), so neither
    the number of masked tokens nor the 1/t weight adds variance.
    stratified, other schedules: evenly spaced times t_k, Bernoulli masking, weight w(t)."""
    G, N = scored_GN.shape
    device = scored_GN.device
    u_rand = torch.rand(G, N, generator=gen, dtype=torch.float64).to(device)
    if stratified and schedule_name == "linear":
        n_G = scored_GN.sum(-1).to(torch.float64)
        frac = torch.remainder(u_G.to(device) + k / K, 1.0)
        l_G = (1 + torch.floor(frac * n_G)).clamp(max=n_G.clamp_min(1))
        ranks = torch.where(scored_GN, u_rand, torch.full_like(u_rand, 2.0)).argsort(-1).argsort(-1)
        masked = scored_GN & (ranks < l_G[:, None])
        weight = torch.where(n_G > 0, n_G / l_G, torch.zeros_like(n_G))
        return masked, weight
    t_G = time_samples(u_G, K, stratified, gen)[:, k].to(device)
    masked = scored_GN & (u_rand < (1.0 - schedule.alpha(t_G))[:, None])
    return masked, schedule.weight(t_G).double()


def predictor_hidden(
    model: torch.nn.Module,
    tokens_BL: torch.Tensor,
    noisy_BL: torch.Tensor,
    how: ScoringModel,
    docs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model call of scoring: hidden states [B, L, E] whose row i is the state that predicts token
    i, and bool [B, L]: which positions have a predictor (not position 0 of AR and shifted models).

    mdlm: one bidirectional pass over `noisy_BL` (shifted: row i is the state at i - 1). block:
    [noisy ; clean] under the block-diffusion mask, the noisy half (or, shifted, hidden i-1 and the
    clean one at a block start). ar: a causal pass over the clean `tokens_BL`, hidden i-1 predicting
    token i. `docs`: document ids (padding)."""
    B, L = tokens_BL.shape
    device = tokens_BL.device
    has = torch.ones(B, L, dtype=torch.bool, device=device)
    positions = torch.arange(L, device=device).expand(B, L)
    if how.kind == "ar":
        hidden = model(tokens_BL, positions, AttentionMask("causal", doc_ids_BL=docs)).hidden_BLE
        has[:, 0] = False
        return torch.cat([hidden[:, :1], hidden[:, :-1]], dim=1), has
    if how.kind == "block":
        assert how.block_size is not None
        tokens2, positions2, mask2 = two_halves(
            noisy_BL, tokens_BL, docs, how.block_size, noisy_only=not how.shift, causal_context=how.causal_context
        )
        hidden = model(tokens2, positions2, mask2).hidden_BLE
        if not how.shift:
            return hidden[:, :L], has
        rows = shifted_rows(L, how.block_size, device).expand(B, L)
        has[:, 0] = False
        return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1])), has
    hidden = model(noisy_BL, positions, AttentionMask("bidirectional", doc_ids_BL=docs)).hidden_BLE
    if not how.shift:
        return hidden, has
    # Dream-style shift, as the mdlm objective trains it: hidden i-1 predicts token i, position 0 its own
    rows = (torch.arange(L, device=device) - 1).clamp_min(0)
    return hidden[:, rows], has


def guided_hidden(model, tokens_BL, noisy_BL, scored_BL, how: ScoringModel, docs, cfg_scale: float):
    """mdlm with guidance: (cond, uncond, w) hidden states for `_row_ce`; the uncond pass masks the
    context (the unscored, unmasked tokens), as LLaDA evaluates. Without guidance, the plain states."""
    cond, _ = predictor_hidden(model, tokens_BL, noisy_BL, how, docs)
    if cfg_scale <= 0:
        return cond
    uncond = torch.where(~scored_BL & (tokens_BL != how.mask_id), how.mask_id, noisy_BL)
    return cond, predictor_hidden(model, tokens_BL, uncond, how, docs)[0], cfg_scale


def _row_ce(model, hidden, selected_BL, targets_BL, mask_id: int | None, weights_BL=None) -> torch.Tensor:
    """sum over each row's selected positions of weight * -log p(target), float64 [B]; the mask id is
    excluded from the distribution unless `mask_id` is None (an AR model's exact NLL)."""
    B = selected_BL.shape[0]
    rows = selected_BL.nonzero()[:, 0]
    if rows.numel() == 0:
        return torch.zeros(B, dtype=torch.float64)
    if isinstance(hidden, tuple):  # guidance: logits = uncond + (1 + w) (cond - uncond)
        cond, unc, w = hidden
        lc, lu = model.logits(cond[selected_BL]).double(), model.logits(unc[selected_BL]).double()
        logits = lu + (1 + w) * (lc - lu)
        if mask_id is not None:
            logits[:, mask_id] = float("-inf")
        ce_N = torch.nn.functional.cross_entropy(logits, targets_BL[selected_BL], reduction="none")
    else:  # the fused head + CE (never the [N, V] logits) of the same soft-capped logits `model.logits` gives
        features, weight, bias = model.head(hidden[selected_BL])
        exclude = () if mask_id is None else (mask_id,)
        cap = getattr(getattr(model, "cfg", None), "final_logit_softcap", None)
        _, ce_N = linear_cross_entropy(features, weight, targets_BL[selected_BL], exclude_ids=exclude, bias_V=bias,
                                       softcap=cap)  # fmt: skip
    ce_N = ce_N.double()
    if weights_BL is not None:
        ce_N = ce_N * weights_BL[selected_BL].double()
    return torch.zeros(B, dtype=torch.float64, device=ce_N.device).index_add_(0, rows, ce_N).cpu()


def score_artifact(
    model: torch.nn.Module, artifact, how: ScoringModel, limit: int | None, batch_size: int, num_samples: int,
    antithetic: bool, seed: int, device: torch.device,
) -> list[NelboSamples]:  # fmt: skip
    """Monte Carlo samples of the bound (or the exact NLL) for the first `limit` rows of a prepared artifact
    (data.artifact.Artifact), a batch at a time; an indexed row's padding is a document of its own."""
    import numpy as np

    from dllm.data.loader import StepLoader

    loader = StepLoader(artifact, global_batch_size=1, micro_batch_size=1, shuffle=False)
    rows = artifact.num_sequences if limit is None else min(limit, artifact.num_sequences)
    gen = torch.Generator().manual_seed(seed)
    parts = []
    for lo in range(0, rows, batch_size):
        batch = loader.read(np.arange(lo, min(lo + batch_size, rows)))
        valid = None if batch.doc_ids_BL is None or artifact.manifest["layout"] != "indexed" else batch.doc_ids_BL == 0
        parts.append(
            nelbo_samples(
                model, batch.tokens_BL.to(device), batch.loss_mask_BL.to(device), how, num_samples=num_samples,
                antithetic=antithetic, generator=gen, valid_BL=None if valid is None else valid.to(device),
            )
        )  # fmt: skip
    return parts


@dataclass
class LikelihoodSummary:
    nelbo_per_token: float
    """Mean bound per scored token (nats): total over rows / scored tokens."""
    mc_stderr: float
    """Standard error of that mean from the Monte Carlo samples (this data, this many samples)."""
    data_stderr: float
    """Standard error over rows (ratio estimator): how much the number would move with other data."""
    ppl_bound: float
    """exp(nelbo_per_token): an upper bound on the perplexity (exact for AR models)."""
    tokens: int
    rows: int
    mc_samples: int
    forward_passes: int
    exact: bool

    def as_dict(self) -> dict[str, float | int | bool]:
        return dict(self.__dict__)


def summarize(parts: list[NelboSamples], exact: bool = False) -> LikelihoodSummary:
    samples = torch.cat([p.samples_BK for p in parts])  # [R, K]
    tokens = torch.cat([p.tokens_B for p in parts]).double()
    R, K = samples.shape
    n_tok = float(tokens.sum())
    if n_tok == 0:
        raise ValueError("no scored tokens: nothing to evaluate")
    per_row = samples.mean(1)
    mean = float(per_row.sum() / n_tok)
    # Monte Carlo error: each row's mean of K samples has variance var_k / K (rows independent).
    # For stratified samples the sample variance over-estimates it: this is a conservative bound.
    mc_var = (samples.var(1, unbiased=True) / K).sum() if K > 1 else torch.tensor(0.0)
    mc_stderr = float(mc_var.sqrt() / n_tok)
    # over rows: the ratio estimator sum(y) / sum(n), linearised (delta method)
    resid = per_row - mean * tokens
    data_stderr = float(resid.std(unbiased=True) * math.sqrt(R) / n_tok) if R > 1 else 0.0
    return LikelihoodSummary(
        nelbo_per_token=mean, mc_stderr=mc_stderr, data_stderr=data_stderr, ppl_bound=math.exp(min(mean, 700.0)),
        tokens=int(n_tok), rows=R, mc_samples=K, forward_passes=sum(p.forward_passes for p in parts), exact=exact,
    )  # fmt: skip


def scoring_for(loaded, kind: str = "auto") -> ScoringModel:
    """How to score a loaded model (checkpoint.loading.LoadedModel), from its decode profile: the
    block bound for block models, the masked bound otherwise; `ar` (exact) for a causal model: a causal run,
    or a causal LM folder never trained here (models.families.base.is_causal_model)."""
    from dllm.errors import ConfigError

    profile = loaded.profile
    if kind not in ("auto", "mdlm", "block", "ar"):
        raise ConfigError(f"kind: {kind!r} is not one of auto, mdlm, block, ar")
    if profile.attention == "prefix_canvas":
        raise ConfigError(
            "this model denoises uniform-state canvases after a causally encoded prefix (DiffusionGemma): the "
            "masked and block bounds do not apply to it; evaluate it with tasks"
        )
    if profile.corruption == "uniform" and profile.attention == "bidirectional":
        raise ConfigError(
            "this run was trained with the uniform objective (a simplified x0 loss without a mask token): "
            "it has no likelihood bound here; evaluate it with tasks"
        )
    if profile.generation == "edit_flow":
        raise ConfigError(
            "this run was trained with edit_flow (edit rates, no mask canvas): the masked and block bounds do not "
            "apply; evaluate it with tasks"
        )
    if kind == "ar" or (kind == "auto" and _is_causal(loaded)):  # a causal model: its exact likelihood
        _check_causal(loaded)
        return ScoringModel("ar", profile.mask_id)
    if profile.attention == "block":
        if kind == "mdlm":
            raise ConfigError(
                f"kind: mdlm, but this run was trained with {profile.objective} (a block model); use auto"
            )
        if profile.corruption != "mask":
            raise ConfigError("objective.corruption: the block bound is computed for mask corruption only")
        return ScoringModel("block", profile.mask_id, block_size=profile.block_size, shift=profile.shift,
                            schedule=profile.schedule, causal_context=profile.causal_context)  # fmt: skip
    if kind == "block":
        raise ConfigError("kind: block needs a run trained with bd3lm or fast_dllm_v2 (its block size)")
    return ScoringModel("mdlm", profile.mask_id, shift=profile.shift, schedule=profile.schedule)


def _is_causal(loaded) -> bool:
    from dllm.models.families.base import is_causal_model

    return loaded.profile.attention == "causal" or is_causal_model(loaded.profile, loaded.model_cfg)


def _check_causal(loaded) -> None:
    """`ar` is the exact likelihood of a causal model only (the same test as `generate --ar`): through a
    causal mask a bidirectional or block model's predictions are no likelihood of anything."""
    from dllm.errors import ConfigError

    profile = loaded.profile
    if _is_causal(loaded):
        return
    trained = f"trained with {profile.objective}" if profile.objective else f"a {loaded.model_cfg.family} model"
    raise ConfigError(
        f"kind: ar scores causal (AR) models, but {loaded.source} is not one ({trained}, attention "
        f"{profile.attention} in its decode profile); use kind auto for its bound"
    )
