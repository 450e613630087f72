"""Train Medusa heads for a frozen target by self-distillation, save them, and report held-out acceptance.

Medusa-1 (Cai et al. 2024): the target stays frozen and only the heads of
:class:`~specserve.drafters.medusa.MedusaHeads` learn. One target forward per batch gives both the
features the heads read (its last hidden state, as served) and its next-token distributions; head
k on the feature of position t is pulled towards the target's own distribution at position t + k
(the token t + k + 1) with KL(target ‖ head), averaged over heads and positions. Distilling the
target's distribution rather than the corpus's next tokens teaches the heads what the target
would say, which is what verification accepts.

:func:`train_medusa` is the end-to-end recipe behind ``specserve train medusa``: load the target and
its tokenizer, tokenize the corpus (or a folder of text), train with the shared loop (checkpoints in
``out_dir/checkpoints``, resumed when present), measure teacher-forced agreement and head 1's top-r
hit rates (stored in ``config.json``: they shape dynamic trees), save the heads, run the real engine
on held-out prompts (a chain, a static and a dynamic tree, greedy) and write ``training_summary.json``
and ``README.md``. :func:`train_heads` does the training on an in-memory target. Every random
choice is seeded; the heads start at zero, so their initialisation draws nothing.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, select_features
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.drafters.medusa import MedusaConfig, MedusaDrafter, MedusaHeads
from specserve.training import heads as common
from specserve.training import loop

# Sized for the default target (8 layers x 512, vocabulary 8192) on a 2-core CPU with bf16 autocast: about
# 1.5 s a step on an idle machine, so the defaults train in under 10 minutes (the saved README.md records the real
# time); float32 is several times slower there.
DEFAULT_STEPS = 300
DEFAULT_BATCH_SIZE = 8
DEFAULT_SEQ_LEN = 256
DEFAULT_PEAK_LR = 1e-3
RANKS = 8  # head 1's top-r hit rates measured for dynamic trees
REPORT_TOPOLOGY = TreeTopology.from_lists(  # a small Medusa-style static tree for the acceptance report
    [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]
)


# ---------------------------------------------------------------------------------------------
# Loss and training on an in-memory target


def forward_target(target: PreTrainedModel, input_ids: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One frozen target forward over ``input_ids`` [batch, seq]: the features ``[batch, seq, hidden]`` at
    ``layer`` (as served) and the target's next-token log-probabilities ``[batch, seq, vocab]`` (float32)."""
    with torch.no_grad():
        out = target(input_ids=input_ids, output_hidden_states=True)
        features = select_features(out.hidden_states, (layer,))
        return features, torch.log_softmax(out.logits.float(), dim=-1)


def medusa_loss(target: PreTrainedModel) -> loop.LossFn:
    """KL(target at t + k ‖ head k at t) per position and head, averaged (the loss ``loop.train`` minimises)."""
    lm_head = common.output_head(target)

    def loss_fn(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        assert isinstance(model, MedusaHeads)
        features, target_logp = forward_target(target, batch, model.config.target_num_layers)
        hidden = model.hidden(features)  # [batch, seq, K, hidden]
        seq = int(batch.shape[1])
        losses = []
        for k in range(1, model.config.num_heads + 1):
            head_logp = torch.log_softmax(lm_head(hidden[:, : seq - k, k - 1]).float(), dim=-1)
            teacher = target_logp[:, k:]
            losses.append((teacher.exp() * (teacher - head_logp)).sum(-1).mean())
        return torch.stack(losses).mean()

    return loss_fn


def heads_for(target: PreTrainedModel, num_heads: int = 4, layers_per_head: int = 1) -> MedusaHeads:
    """Untrained (zero) heads shaped for ``target``: each starts as the target's own LM head."""
    weight = common.output_head(target).weight  # [vocab, hidden]
    if not isinstance(weight, torch.Tensor):
        raise UserError(f"the LM head of {type(target).__name__} has no weight matrix to decode Medusa heads with")
    config = MedusaConfig(
        num_heads=num_heads,
        hidden_size=int(weight.shape[1]),
        vocab_size=int(weight.shape[0]),
        target_num_layers=int(target.config.num_hidden_layers),
        num_layers_per_head=layers_per_head,
        target_architecture=type(target).__name__,
    )
    return MedusaHeads(config).to(dtype=weight.dtype, device=weight.device)


def train_heads(
    target: PreTrainedModel,
    stream: torch.Tensor,  # [num_tokens] training token ids
    cfg: loop.TrainConfig,
    heads: MedusaHeads,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 50,
) -> dict[str, float]:
    """Train ``heads`` in place on ``stream`` against the frozen ``target``; the loop's summary."""
    common.frozen(target)
    return loop.train(
        heads, stream, medusa_loss(target), cfg, desc="medusa heads", checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )  # fmt: skip


@torch.inference_mode()
def teacher_forced(
    target: PreTrainedModel, heads: MedusaHeads, stream: torch.Tensor, seq_len: int = 128, windows: int = 16
) -> dict[str, list[float]]:
    """On consecutive held-out windows: how often head k's top-1 is the target's greedy token at t + k + 1
    (``top1_by_head``), and how often that token is head 1's rank-r candidate (``rank_probs``, r < RANKS)."""
    lm_head = common.output_head(target)
    count = max(1, min(windows, (stream.numel() - 1) // seq_len))
    agree = torch.zeros(heads.config.num_heads, dtype=torch.float64)
    totals = torch.zeros(heads.config.num_heads, dtype=torch.float64)
    ranks = torch.zeros(RANKS + 1, dtype=torch.float64)
    for i in range(count):
        window = stream[i * seq_len : (i + 1) * seq_len][None]
        features, target_logp = forward_target(target, window, heads.config.target_num_layers)
        greedy = target_logp[0].argmax(-1)  # [seq]: the target's token after each position
        logits = heads(features[0], lm_head)  # [seq, K, vocab]
        for k in range(1, heads.config.num_heads + 1):
            wanted, head_logits = greedy[k:], logits[: greedy.numel() - k, k - 1]
            agree[k - 1] += (head_logits.argmax(-1) == wanted).sum()
            totals[k - 1] += wanted.numel()
            if k == 1:
                above = (head_logits > head_logits.gather(1, wanted[:, None])).sum(-1)
                ranks += torch.bincount(above.clamp(max=RANKS), minlength=RANKS + 1).double()
    rank_probs = ranks[:RANKS] / max(float(totals[0]), 1.0)
    return {
        "top1_by_head": (agree / totals.clamp(min=1)).tolist(),
        "rank_probs": [max(float(p), 1e-4) for p in rank_probs],  # best_first needs every rate > 0
    }


def report_specs(num_heads: int) -> dict[str, tuple[int, TreeSpec | None]]:
    """The acceptance report's shapes: name -> (gamma, tree)."""
    return {
        "chain": (num_heads, None),
        "static_tree": (num_heads, TreeSpec("static", topology=REPORT_TOPOLOGY)),
        "dynamic_tree": (num_heads, TreeSpec("dynamic", budget=TreeBudget(depth=num_heads, width=4, nodes=16))),
    }


def acceptance_report(
    target: CausalLM, heads: MedusaHeads, prompts: list[str] | list[list[int]], max_new_tokens: int = 64
) -> dict[str, dict[str, Any]]:
    """Greedy decoding with the real engine on ``prompts``: mean accepted length per shape of :func:`report_specs`."""
    drafter = MedusaDrafter.for_target(heads, target)
    return {
        name: common.heldout_acceptance(target, drafter, prompts, max_new_tokens, gamma=gamma, tree=tree)
        for name, (gamma, tree) in report_specs(heads.config.num_heads).items()
    }


# ---------------------------------------------------------------------------------------------
# The recipe


def train_medusa(
    target_dir: str | Path,
    out_dir: str | Path,
    *,
    heads: int = 4,
    layers_per_head: int = 1,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    seq_len: int = DEFAULT_SEQ_LEN,
    peak_lr: float = DEFAULT_PEAK_LR,
    seed: int = 0,
    data_folder: str | Path | None = None,
    max_tokens: int | None = None,
    checkpoint_every: int = 50,
    report_prompts: int = 4,
    report_tokens: int = 64,
    bf16_autocast: bool = True,
) -> dict[str, Any]:
    """Train ``heads`` Medusa heads for the target in ``target_dir`` and save them in ``out_dir``.

    Data: the default corpus (standard library) or the text files of ``data_folder``, at most
    ``max_tokens`` per split. Checkpoints go to ``out_dir/checkpoints`` every ``checkpoint_every``
    steps; a rerun with the same settings resumes there. The acceptance report uses
    ``report_prompts`` benchmark prompts (:func:`~specserve.training.corpus.heldout_prompts`) for the
    default target on the default corpus, else the openings of held-out windows, and decodes
    ``report_tokens`` tokens each. ``bf16_autocast`` runs the training forwards (the target's too) in
    bfloat16, as the default pair was trained; measurement and serving stay in float32. Returns the
    summary also written to ``training_summary.json``.
    """
    started = time.perf_counter()
    out = Path(out_dir)
    target = CausalLM.load(target_dir, dtype="float32")
    if target.tokenizer is None:
        raise UserError(f"{target_dir} has no tokenizer; Medusa training needs the target's tokenizer to read text")
    model = common.frozen(target.model)
    train_stream, heldout_stream = common.token_streams(target.tokenizer, data_folder, max_tokens)
    if min(train_stream.numel(), heldout_stream.numel()) <= seq_len + 1:
        raise UserError(f"too little text for windows of {seq_len} tokens; lower seq_len or give more data")

    cfg = loop.head_config(steps, batch_size, seq_len, peak_lr, seed, bf16_autocast)
    medusa = heads_for(model, heads, layers_per_head)
    before = teacher_forced(model, medusa, heldout_stream, seq_len)
    run = train_heads(model, train_stream, cfg, medusa, out / "checkpoints", checkpoint_every)
    after = teacher_forced(model, medusa, heldout_stream, seq_len)
    medusa.config = replace(medusa.config, rank_probs=tuple(after["rank_probs"]))
    medusa.save(out)

    prompts = common.report_prompts(target, data_folder, heldout_stream, report_prompts, report_tokens)
    summary: dict[str, Any] = {
        "kind": "medusa",
        "target": {
            "path": str(target_dir),
            "architecture": target.info.architecture,
            "num_layers": medusa.config.target_num_layers,
            "hidden_size": medusa.config.hidden_size,
            "vocab_size": medusa.config.vocab_size,
        },
        "heads": {
            "num_heads": heads,
            "num_layers_per_head": layers_per_head,
            "parameters": sum(p.numel() for p in medusa.parameters()),
        },
        "train_config": asdict(cfg),
        "data": {
            "folder": None if data_folder is None else str(data_folder),
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
        },
        "train": run,
        "teacher_forced": {"untrained": before, "trained": after},
        "acceptance": acceptance_report(target, medusa, prompts, report_tokens),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    summary["total_seconds"] = time.perf_counter() - started
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(render_card(summary))
    return summary


def render_card(summary: dict[str, Any]) -> str:
    """The ``README.md`` of a heads directory: what it is, its target, the recipe and the numbers."""
    target, heads, cfg, run = summary["target"], summary["heads"], summary["train_config"], summary["train"]
    before, after = summary["teacher_forced"]["untrained"], summary["teacher_forced"]["trained"]
    pairs = zip(before["top1_by_head"], after["top1_by_head"], strict=True)
    top1 = " | ".join(f"{a:.3f} → **{b:.3f}**" for a, b in pairs)
    header = " | ".join(f"head {k + 1}" for k in range(heads["num_heads"]))
    rows = "\n".join(
        f"| {name} | {report['tree'] or 'chain of ' + str(report['gamma'])} | **{report['mean_accepted_length']:.2f}** "
        f"| {report['cycles']} |"
        for name, report in summary["acceptance"].items()
    )
    data = summary["data"]["folder"] or "the default corpus (standard library sources)"
    first = next(iter(summary["acceptance"].values()))
    return f"""# Medusa heads for `{target["path"]}`

{heads["num_heads"]} Medusa-1 heads (Cai et al. 2024) for the {target["architecture"]} target at `{target["path"]}`
({target["num_layers"]} layers, hidden size {target["hidden_size"]}, {target["vocab_size"]} tokens), trained by
`specserve train medusa`. Head k reads the target's last hidden state (after its final norm) at position t
and predicts the token at t + k + 1 through {heads["num_layers_per_head"]} residual block(s) `h + SiLU(W h + b)`
and the target's own frozen LM head. The directory holds only the heads ({heads["parameters"]:,} parameters):
serving uses the target's LM head. Drafts are deterministic, so decoding with them is exact at any temperature.

Draft with it: `specserve generate --target {target["path"]} --draft medusa:DIR`; as a library,
`MedusaDrafter.load(DIR, target)`. Reproduce: `specserve train medusa --target {target["path"]}`.

## Recipe

- Self-distillation: KL(target at t + k ‖ head k at t), averaged over heads and positions; the target is frozen.
- Data: {data}; {summary["data"]["train_tokens"]:,} training tokens, {summary["data"]["heldout_tokens"]:,} held out.
- {cfg["steps"]} steps x {cfg["batch_size"]} windows of {cfg["seq_len"]} tokens, AdamW (0.9, 0.95),
  peak LR {cfg["peak_lr"]}, {cfg["warmup_steps"]} warmup steps then cosine to {cfg["min_lr_ratio"]}x,
  weight decay {cfg["weight_decay"]}, {"bf16 autocast" if cfg["bf16_autocast"] else "float32"}, seed {cfg["seed"]}.
- Heads start at zero (each as the LM head). Training took {run["seconds"] / 60:.1f} min
  (final loss {run["final_loss"]:.3f}); the whole recipe {summary["total_seconds"] / 60:.1f} min
  (torch {summary["torch"]}, Python {summary["python"]}).

## Numbers

Teacher-forced on held-out text, how often head k's top-1 is the target's greedy token (untrained → trained):

| {header} |
|{"---|" * heads["num_heads"]}
| {top1} |

Head 1's top-r hit rates (stored in `config.json` as `rank_probs`, they shape dynamic trees):
{", ".join(f"{p:.3f}" for p in after["rank_probs"])}.

Greedy decoding with the real engine on {first["prompts"]} held-out prompts, {first["max_new_tokens"]} new tokens each
(mean accepted length = tokens per target pass):

| shape | drafted | mean accepted length | cycles |
|---|---|---|---|
{rows}
"""
