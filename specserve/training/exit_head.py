"""Train a layer-skip exit head (:class:`~specserve.drafters.layerskip.ExitHead`) on a frozen target.

The early-exit view drafts with the target's first L layers, then its final norm and LM head; the
exit head is a small residual MLP between layer L and that norm, trained so the view's next-token
distribution matches the whole target's: the loss is KL(target ‖ view) per position, averaged.
Each batch is one target forward (no grad) giving both the layer-L hidden states
(``hidden_states[L]``, the numbering of :func:`~specserve.core.model.causal_lm.select_features`) and the
target's logits; the head, then the target's frozen norm and LM head, run on those states with
gradients flowing only into the head. The head starts as the identity (plain layer-skip), so the
"untrained" numbers of the report are plain layer-skip's.

:func:`train_exit_head` is the ``specserve train exit-head`` command: load the target, token
streams, the loop with checkpoints and resume (:func:`specserve.training.loop.train`), the saved head
directory, a held-out acceptance report before and after (greedy, γ 3, the real engine), a
teacher-forced agreement report, ``training_summary.json`` and the ``README.md`` card.
:func:`train_exit_head_on` does the same for an already loaded target and streams (tests, notebooks).
Does not serve the head (:mod:`specserve.drafters.layerskip`) or wire the command line.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.drafters.layerskip import ExitHead, LayerSkipDrafter, decoder_stack, save_exit_head
from specserve.training import heads, loop
from specserve.training.loop import LossFn


@dataclass(frozen=True)
class ExitHeadRecipe:
    """Defaults sized for the default target (8 layers x 512, vocab 8192): 500 steps of 8 x 256 tokens, about
    1 s a step on 2 idle CPU cores (one bf16 target forward dominates), so about 10 minutes with the reports."""

    layers: int = 4  # the exit head reads the hidden state after this many target layers
    intermediate_size: int | None = None  # the head's MLP width (None: the target's hidden size)
    steps: int = 500
    batch_size: int = 8
    seq_len: int = 256
    peak_lr: float = 1e-3
    seed: int = 0
    bf16_autocast: bool = True
    max_tokens: int | None = 2_000_000  # of each token stream (None: all of it)
    checkpoint_every: int = 50
    report_prompts: int = 4  # held-out prompts of the acceptance report
    report_tokens: int = 64  # new tokens per report prompt
    report_gamma: int = 3


# ---------------------------------------------------------------------------------------------
# Loss and measurements


def early_exit_logits(
    target: PreTrainedModel,
    exit_head: ExitHead | None,
    hidden: torch.Tensor,  # [batch, seq, hidden] the target's state after layer L
) -> torch.Tensor:  # [batch, seq, vocab]
    """The early-exit view's logits from the layer-L states: exit head, the target's final norm, its LM head."""
    if exit_head is not None:
        hidden = exit_head(hidden)
    return heads.output_head(target)(decoder_stack(target)[0].norm(hidden))


def exit_head_loss(target: PreTrainedModel, layers: int) -> LossFn:
    """KL(target ‖ early-exit view) per position, averaged, on windows ``[batch, seq + 1]`` of a frozen target."""

    def loss_fn(head: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        assert isinstance(head, ExitHead)
        with torch.no_grad():
            out = target(input_ids=batch[:, :-1], output_hidden_states=True)
            target_logp = torch.log_softmax(out.logits.float(), dim=-1)
            hidden = out.hidden_states[layers]
        draft_logp = torch.log_softmax(early_exit_logits(target, head, hidden).float(), dim=-1)
        return (target_logp.exp() * (target_logp - draft_logp)).sum(-1).mean()

    return loss_fn


@torch.inference_mode()
def teacher_forced_agreement(
    target: PreTrainedModel,
    layers: int,
    exit_head: ExitHead | None,
    stream: torch.Tensor,  # [num_tokens] held-out token ids
    seq_len: int = 256,
    windows: int = 16,
) -> dict[str, float]:
    """Per-token agreement of the early-exit view with the target on consecutive windows of ``stream``: top-1
    (greedy acceptance), Σ min(target, view) (acceptance at temperature 1) and KL(target ‖ view) in nats."""
    seq_len = min(seq_len, stream.numel())
    count = max(1, min(windows, stream.numel() // seq_len))
    greedy = sampled = kl = 0.0
    for i in range(count):
        window = stream[i * seq_len : (i + 1) * seq_len][None].to(target.device)
        out = target(input_ids=window, output_hidden_states=True)
        target_logp = torch.log_softmax(out.logits.float()[0], dim=-1)
        draft_logp = torch.log_softmax(early_exit_logits(target, exit_head, out.hidden_states[layers]).float()[0], -1)
        greedy += (target_logp.argmax(-1) == draft_logp.argmax(-1)).float().mean().item()
        sampled += torch.minimum(target_logp.exp(), draft_logp.exp()).sum(-1).mean().item()
        kl += (target_logp.exp() * (target_logp - draft_logp)).sum(-1).mean().item()
    return {"greedy": greedy / count, "temperature_1": sampled / count, "kl_nats": kl / count}


def acceptance_report(
    target: CausalLM, layers: int, exit_head: ExitHead, prompts: Sequence[Any], recipe: ExitHeadRecipe
) -> dict[str, Any]:
    """Held-out greedy acceptance of the early-exit view with ``exit_head`` as a γ-chain, in the real engine."""
    drafter = LayerSkipDrafter(target, layers, exit_head)
    report = heads.heldout_acceptance(target, drafter, prompts, recipe.report_tokens, gamma=recipe.report_gamma)
    return {f"chain_gamma_{recipe.report_gamma}": report}


# ---------------------------------------------------------------------------------------------
# Training


def new_exit_head(target: PreTrainedModel, recipe: ExitHeadRecipe) -> ExitHead:
    """An untrained (identity) exit head for ``target`` (on its device, in its dtype), its random part drawn
    from ``recipe.seed``."""
    config = target.config
    generator = torch.Generator().manual_seed(recipe.seed)
    eps = float(getattr(config, "rms_norm_eps", 1e-6))
    head = ExitHead(int(config.hidden_size), recipe.intermediate_size, eps, generator=generator)
    return head.to(device=target.device, dtype=target.dtype)


def fit_exit_head(
    head: ExitHead,
    target: PreTrainedModel,
    stream: torch.Tensor,  # [num_tokens] training token ids
    recipe: ExitHeadRecipe,
    checkpoint_dir: Path | None = None,
) -> dict[str, float]:
    """Train ``head`` in place on ``stream`` (the target is frozen); the loop's summary."""
    cfg = loop.head_config(
        recipe.steps, recipe.batch_size, recipe.seq_len, recipe.peak_lr, recipe.seed, recipe.bf16_autocast
    )
    loss_fn = exit_head_loss(heads.frozen(target), recipe.layers)
    return loop.train(
        head, stream, loss_fn, cfg, desc=f"exit head (layer {recipe.layers})", checkpoint_dir=checkpoint_dir,
        checkpoint_every=recipe.checkpoint_every,
    )  # fmt: skip


def train_exit_head_on(
    target: CausalLM,
    out_dir: str | Path,
    train_stream: torch.Tensor,  # [num_tokens]
    heldout_stream: torch.Tensor,  # [num_tokens]
    prompts: Sequence[Any],  # strings (the target has a tokenizer) or token id lists
    recipe: ExitHeadRecipe | None = None,
) -> dict[str, Any]:
    """Train an exit head for a loaded ``target``, save it to ``out_dir`` with its report and card; the summary."""
    recipe = recipe or ExitHeadRecipe()
    out = Path(out_dir)
    start = time.perf_counter()
    model = heads.frozen(target.model)
    depth = len(decoder_stack(model)[1])
    if not 1 <= recipe.layers < depth:
        raise UserError(f"the exit head needs 1 <= layers < {depth} (the target's depth), got {recipe.layers}")
    if train_stream.numel() <= recipe.seq_len + 1:
        raise UserError(
            f"the training stream has {train_stream.numel()} tokens, too few for windows of {recipe.seq_len}; "
            "use more data or a shorter seq_len"
        )
    head = new_exit_head(model, recipe)
    tf_before = teacher_forced_agreement(model, recipe.layers, None, heldout_stream, recipe.seq_len)
    before = acceptance_report(target, recipe.layers, head, prompts, recipe)
    run = fit_exit_head(head, model, train_stream, recipe, out / "checkpoints")
    tf_after = teacher_forced_agreement(model, recipe.layers, head, heldout_stream, recipe.seq_len)
    after = acceptance_report(target, recipe.layers, head, prompts, recipe)
    save_exit_head(out, head, target, recipe.layers)
    summary: dict[str, Any] = {
        "kind": "exit-head",
        "target": target.info.path,
        "target_num_layers": depth,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_tokens": int(train_stream.numel()),
        "heldout_tokens": int(heldout_stream.numel()),
        "train": run,
        "teacher_forced": {"untrained": tf_before, "trained": tf_after},
        "heldout_acceptance": {"untrained": before, "trained": after},
        "total_seconds": time.perf_counter() - start,
    }
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    heads.write_head_card(out, summary, f"Layer-skip exit head (layer {recipe.layers})", card_body(summary))
    return summary


def train_exit_head(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    layers: int = ExitHeadRecipe.layers,
    steps: int = ExitHeadRecipe.steps,
    batch_size: int = ExitHeadRecipe.batch_size,
    seq_len: int = ExitHeadRecipe.seq_len,
    seed: int = ExitHeadRecipe.seed,
    data_folder: str | Path | None = None,
    max_tokens: int | None = ExitHeadRecipe.max_tokens,
    checkpoint_every: int = ExitHeadRecipe.checkpoint_every,
    report_prompts: int = ExitHeadRecipe.report_prompts,
    intermediate_size: int | None = None,
    peak_lr: float = ExitHeadRecipe.peak_lr,
    bf16_autocast: bool = ExitHeadRecipe.bf16_autocast,
) -> dict[str, Any]:
    """``specserve train exit-head``: train an exit head reading layer ``layers`` of the target in ``target_dir``
    (float32, frozen) on the default corpus or ``data_folder``, and save it to ``out_dir`` (a run killed
    after a checkpoint resumes from ``out_dir/checkpoints``). Returns the training summary."""
    recipe = ExitHeadRecipe(
        layers=layers,
        intermediate_size=intermediate_size,
        steps=steps,
        batch_size=batch_size,
        seq_len=seq_len,
        peak_lr=peak_lr,
        seed=seed,
        bf16_autocast=bf16_autocast,
        max_tokens=max_tokens,
        checkpoint_every=checkpoint_every,
        report_prompts=report_prompts,
    )
    target = CausalLM.load(target_dir, dtype="float32")  # AutoModelForCausalLM, local files only
    if target.tokenizer is None:
        raise UserError(f"{target_dir} has no tokenizer; exit head training needs the target's tokenizer")
    train_stream, heldout_stream = heads.token_streams(target.tokenizer, data_folder, recipe.max_tokens)
    prompts = heads.report_prompts(target, data_folder, heldout_stream, recipe.report_prompts, recipe.report_tokens)
    return train_exit_head_on(target, out_dir, train_stream, heldout_stream, prompts, recipe)


# ---------------------------------------------------------------------------------------------
# Card


CARD_BODY = """\
A layer-skip exit head for the target above: a residual MLP, h + W2 SiLU(W1 RMSNorm(h)), on the target's
hidden state after layer {layers} of {depth}, followed by the target's own frozen final norm and LM head.
The early-exit view (the target's first {layers} layers, this head, the norm, the LM head) drafts for the
whole target; the head holds none of the target's weights and fits only that target:
`specserve generate --draft layerskip:DIR`. Trained by distillation, KL(target ‖ view) per position, with the
target frozen; W2 starts at zero, so "untrained" below is plain layer-skip. Output stays exactly the
target's — the head changes speed only.

## Teacher-forced agreement with the target (held-out text)

| | top-1 (greedy) | Σ min (temperature 1) | KL (nats) |
|---|---|---|---|
{rows}
"""


def card_body(summary: dict[str, Any]) -> str:
    rows = "\n".join(
        f"| {stage} | {m['greedy']:.3f} | {m['temperature_1']:.3f} | {m['kl_nats']:.3f} |"
        for stage, m in summary["teacher_forced"].items()
    )
    return CARD_BODY.format(layers=summary["recipe"]["layers"], depth=summary["target_num_layers"], rows=rows)
