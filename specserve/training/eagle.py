"""Train an EAGLE head (:mod:`specserve.drafters.eagle`) on a frozen target, with training-time test.

Each batch is one target forward (no grad) giving the features at the head's ``feature_layers``
and the target's next-token distributions; the head is then run ``unroll + 1`` times:

* step 0 — at every position t the real input (fused feature of t, embedding of token t + 1),
  as in the committed part of serving;
* step s ≥ 1 — at position t + s the head's own step-(s-1) output for start t in place of the
  feature (the token is the real one: only accepted paths matter), as when drafting depth s + 1.
  Its attention follows serving exactly: the real entries of positions ≤ t (step 0) and the
  entries of its own chain (steps 1 .. s), expressed as a 4-D mask over the steps' keys and
  values (one growing cache, gradients flowing through it).

The loss is the token loss of EAGLE-3 — KL(target ‖ head) of the distribution of the token after
next, through the head's output head — averaged over positions and steps; EAGLE-1's feature
regression term is available (``feature_weight``), off by default as in EAGLE-3. Only the head's
weights train.

Two architectures (``EagleRecipe.layout``): specserve's own head (the target's frozen LM head reads it; saved in
specserve's layout), or the published EAGLE-3 head (:mod:`specserve.drafters.eagle3`: its own LM head over a draft
vocabulary of the ``draft_vocab`` most frequent tokens of the training stream), saved in SafeAILab's EAGLE-3 layout
with a copy in vLLM's ``speculators`` format under ``speculators/`` (:mod:`specserve.drafters.eagle_export`), so
that SGLang and vLLM load it unchanged. With a reduced draft vocabulary the loss is the reference's: the target's
distribution restricted to the draft vocabulary and renormalised, at positions whose target argmax lies inside it.
:func:`train_eagle` is the ``specserve train eagle`` command: streams, the loop with checkpoints and resume, the
saved head directory, a held-out acceptance report, the card.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel

from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, load_tokenizer, select_features
from specserve.core.tree.shapes import TreeBudget, TreeSpec
from specserve.drafters.eagle import EagleDrafter
from specserve.drafters.eagle3 import Eagle3Config, Eagle3Head
from specserve.drafters.eagle_export import save_eagle3, save_speculators
from specserve.drafters.eagle_head import EagleConfig, EagleHead, FeatureHead, check_head_fits
from specserve.drafters.eagle_layouts import load_head
from specserve.training import heads, loop
from specserve.training.loop import LossFn

LAYOUTS = ("specserve", "eagle3")
SPECULATORS_DIR = "speculators"  # where an EAGLE-3 head's speculators-format copy goes, inside its directory


@dataclass(frozen=True)
class EagleRecipe:
    layout: str = "specserve"  # or "eagle3": the published EAGLE-3 architecture and layout
    draft_vocab: int | None = None  # eagle3: the draft vocabulary's size (None: the target's whole vocabulary)
    speculative_tokens: int = 4  # eagle3: the γ the speculators copy suggests
    feature_layers: tuple[int, ...] | None = None  # specserve: None = low / middle / top layer
    unroll: int = 2  # training-time test: steps the head runs on its own outputs
    feature_weight: float = 0.0  # EAGLE-1's feature regression term (smooth L1 to the target's next feature)
    steps: int = 1200  # 18 min for the default target on a CPU with native bf16; about 45 min in float32 here
    batch_size: int = 8
    seq_len: int = 128
    peak_lr: float = 1.5e-3
    seed: int = 0
    bf16_autocast: bool = True
    max_tokens: int | None = 2_000_000  # of the training stream (None: all of it)
    checkpoint_every: int = 50
    report_prompts: int = 4
    report_tokens: int = 64


def unroll_mask(rows: int, step: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Additive attention mask ``[1, 1, rows, (step + 1) * rows]`` of unroll ``step`` over the cache of steps
    0 .. step: row t sees step 0's positions <= t and its own chain (column s * rows + t for 1 <= s <= step)."""
    allowed = torch.zeros(rows, (step + 1) * rows, dtype=torch.bool, device=device)
    allowed[:, :rows] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    index = torch.arange(rows, device=device)
    for s in range(1, step + 1):
        allowed[index, s * rows + index] = True
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def draft_vocabulary(stream: torch.Tensor, size: int, vocab_size: int) -> list[int]:
    """The ``size`` most frequent tokens of ``stream`` (ties: the lower id), ascending: a reduced draft vocabulary."""
    counts = torch.bincount(stream.flatten().long(), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(-counts, stable=True)[:size]
    return sorted(int(i) for i in order)


def eagle_loss(target: PreTrainedModel, layers: tuple[int, ...], unroll: int, feature_weight: float = 0.0) -> LossFn:
    """The training-time-test loss of a head on windows ``[batch, seq + 1]`` of a frozen target."""
    embeddings = target.get_input_embeddings()
    lm_head = heads.output_head(target)
    top = target.config.num_hidden_layers

    def loss_fn(head: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        assert isinstance(head, FeatureHead)
        output = head.output_head(lm_head)
        # a reduced draft vocabulary: both distributions over it (the target's renormalised), at positions whose
        # target argmax lies inside it, as the reference trains EAGLE-3
        vocab = (
            head.draft_token_ids()
            if isinstance(head, Eagle3Head) and head.config.draft_vocab_size < head.config.vocab_size
            else None
        )
        ids = batch[:, :-1]  # x_0 .. x_{T-1}
        length = ids.shape[1]
        rows = length - 1  # head positions 0 .. T - 2 (position t reads token t + 1)
        with torch.no_grad():
            out = target(input_ids=ids, output_hidden_states=True)
            raw = select_features(out.hidden_states, layers)
            target_logits = out.logits.float()
            inside = None if vocab is None else torch.isin(target_logits.argmax(-1), vocab)
            if vocab is not None:
                target_logits = target_logits[..., vocab]
            target_logp = torch.log_softmax(target_logits, dim=-1)  # row j: the token after j
            top_features = out.hidden_states[top]
            token_embeds = embeddings(batch)  # [batch, T + 1, hidden]
        features = head.fuse_features(raw[:, :rows])
        cache = DynamicCache(config=head.body.config)
        index = torch.arange(rows, device=batch.device)
        total = torch.zeros((), device=batch.device)
        for step in range(unroll + 1):
            target_rows = index + step + 1  # head row t at step s predicts the token after t + s + 1
            valid = target_rows <= length - 1
            if not bool(valid.any()):
                break
            target_rows = target_rows.clamp(max=length - 1)
            mask = unroll_mask(rows, step, features.dtype, batch.device).expand(batch.shape[0], -1, -1, -1)
            positions = (index + step)[None].expand(batch.shape[0], -1)
            hidden = head(features, token_embeds[:, target_rows], cache, mask, positions)
            logits = output(hidden).float()
            logq = torch.log_softmax(logits if vocab is None else logits[..., vocab], dim=-1)[:, valid]
            logp = target_logp[:, target_rows][:, valid]
            kl = (logp.exp() * (logp - logq)).sum(-1)
            if inside is None:
                total = total + kl.mean()
            else:
                weight = inside[:, target_rows][:, valid].float()
                total = total + (kl * weight).sum() / weight.sum().clamp(min=1.0)
            if feature_weight:
                want = top_features[:, target_rows][:, valid].float()
                total = total + feature_weight * torch.nn.functional.smooth_l1_loss(hidden[:, valid].float(), want)
            features = hidden  # the next step drafts from the head's own outputs
        return total / (unroll + 1)

    return loss_fn


def train_head(
    head: FeatureHead, target: PreTrainedModel, stream: torch.Tensor, recipe: EagleRecipe, checkpoint_dir: Path | None
) -> dict[str, float]:
    """Train ``head`` in place on ``stream`` (the target is frozen); the loop's summary."""
    cfg = loop.head_config(
        recipe.steps, recipe.batch_size, recipe.seq_len, recipe.peak_lr, recipe.seed, recipe.bf16_autocast
    )
    loss_fn = eagle_loss(heads.frozen(target), head.config.feature_layers, recipe.unroll, recipe.feature_weight)
    return loop.train(
        head, stream, loss_fn, cfg, desc="eagle head", checkpoint_dir=checkpoint_dir,
        checkpoint_every=recipe.checkpoint_every,
    )  # fmt: skip


def acceptance_report(
    target: CausalLM, head: FeatureHead, prompts: list[str] | list[list[int]], max_new_tokens: int
) -> dict[str, Any]:
    """Held-out greedy acceptance of ``head`` as a chain (γ 4) and a dynamic tree, in the real engine."""
    drafter = EagleDrafter.for_target(head, target)
    tree = TreeSpec("dynamic", budget=TreeBudget(depth=5, width=3, nodes=12))
    return {
        "chain_gamma_4": heads.heldout_acceptance(target, drafter, prompts, max_new_tokens, gamma=4),
        "dynamic_tree": heads.heldout_acceptance(target, drafter, prompts, max_new_tokens, tree=tree),
    }


def train_eagle(
    target_dir: str | Path,
    out_dir: str | Path,
    recipe: EagleRecipe | None = None,
    data_folder: str | Path | None = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """``specserve train eagle``: train a head for the target in ``target_dir`` and save it to ``out_dir`` —
    from scratch, or continuing from the trained head in ``init_from`` (a fresh schedule over its weights)."""
    recipe = recipe or EagleRecipe()
    out = Path(out_dir)
    start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), local_files_only=True, dtype=torch.float32)
    tokenizer = load_tokenizer(target_dir)
    if tokenizer is None:
        raise UserError(f"{target_dir} has no tokenizer; EAGLE training needs the target's tokenizer")
    train_stream, heldout_stream = heads.token_streams(tokenizer, data_folder, recipe.max_tokens)
    head = new_head(model, recipe, train_stream)
    target = CausalLM(heads.frozen(model), tokenizer, path=str(target_dir))
    previous: dict[str, Any] | None = None
    if init_from is not None:
        start_head = load_head(init_from, target).float()
        check_head_fits(start_head, target, int(model.config.hidden_size), int(model.config.num_hidden_layers))
        # a published layout does not record the target's depth (target_num_layers 0): the fit check above did
        config: Any = start_head.config  # EagleConfig or Eagle3Config, both dataclasses
        recorded = replace(config, target_num_layers=head.config.target_num_layers)
        if type(start_head) is not type(head) or recorded != head.config:
            raise UserError(f"{init_from} is a head of another shape ({start_head.config}); train from scratch instead")
        head = start_head.train()
        summary_file = Path(init_from, "training_summary.json")
        previous = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    prompts = heads.report_prompts(target, data_folder, heldout_stream, recipe.report_prompts, recipe.report_tokens)
    before = acceptance_report(target, head, prompts, recipe.report_tokens)
    run = train_head(head, model, train_stream, recipe, out / "checkpoints")
    after = acceptance_report(target, head, prompts, recipe.report_tokens)
    save_trained(head, out, target, recipe)
    summary = {
        "kind": "eagle",
        "target": str(target_dir),
        "recipe": {**asdict(recipe), "feature_layers": list(head.config.feature_layers)},
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_tokens": int(train_stream.numel()),
        "train": run,
        "heldout_acceptance": {"untrained" if init_from is None else "before": before, "trained": after},
        "total_seconds": time.perf_counter() - start,
    }
    if previous is not None:  # a continuation: what the starting head had been through
        summary["init_from"] = {
            "path": str(init_from),
            "recipe": previous.get("recipe"),
            "train": previous.get("train"),
            "init_from": previous.get("init_from"),
        }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    heads.write_head_card(out, summary, "EAGLE head", CARD_BODY if recipe.layout == "specserve" else EAGLE3_CARD_BODY)
    return summary


def new_head(model: PreTrainedModel, recipe: EagleRecipe, stream: torch.Tensor) -> FeatureHead:
    """An untrained head of the recipe's architecture for ``model`` (EAGLE-3: its draft vocabulary from ``stream``)."""
    if recipe.layout not in LAYOUTS:
        raise UserError(f"the EAGLE layout must be one of {', '.join(LAYOUTS)}, got {recipe.layout!r}")
    if recipe.layout == "specserve":
        return EagleHead(EagleConfig.for_target(model, recipe.feature_layers))
    if recipe.feature_layers is not None:
        raise UserError("an EAGLE-3 head reads the reference's layers (2, L//2, L-3); drop --feature-layers")
    config = Eagle3Config.for_target(model, recipe.draft_vocab)
    head = Eagle3Head(config)
    head.set_draft_vocabulary(draft_vocabulary(stream, config.draft_vocab_size, config.vocab_size))
    return head


def save_trained(head: FeatureHead, out: Path, target: CausalLM, recipe: EagleRecipe) -> None:
    """specserve's layout for its own head; SafeAILab's EAGLE-3 layout and a speculators copy for an EAGLE-3 head."""
    if isinstance(head, EagleHead):
        head.save(out, extra={"target": target.info.path})
        return
    assert isinstance(head, Eagle3Head)
    save_eagle3(head, out, extra={"specserve_target": target.info.path})
    architectures = list(getattr(target.model.config, "architectures", None) or [target.info.architecture])
    save_speculators(head, out / SPECULATORS_DIR, target.info.path, architectures, recipe.speculative_tokens)


EAGLE3_CARD_BODY = """\
An EAGLE-3 draft head for the target above, in the published architecture: the inputs of three target layers
(2, L/2, L-3) concatenated and projected, one decoder layer whose attention reads the normed token embedding and the
normed projection side by side, and its own LM head over a reduced draft vocabulary (the most frequent tokens of the
training text; `d2t` maps them to the target's ids). Trained with the token loss and training-time test. This
directory is in SafeAILab's EAGLE-3 layout (SGLang, SpecForge and vLLM load it unchanged); `speculators/` holds the
same head in vLLM's speculators format. `specserve generate --draft eagle:DIR` loads either. Output stays exactly the
target's — the head changes speed only.
"""


CARD_BODY = """\
An EAGLE draft head for the target above: EAGLE-3-style fused features (the target's hidden states at
the feature layers, concatenated and projected), the embedding of the next token, one Llama decoder
layer, and the target's own frozen LM head. Trained with the token loss and training-time test
(the head unrolled on its own outputs). It holds none of the target's weights and drafts only for
that target: `specserve generate --draft eagle:DIR`. Output stays exactly the target's — the head
changes speed only.
"""
