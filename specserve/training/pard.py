"""``specserve train pard``: adapt a draft model to PARD (a block of drafts per forward) for a frozen target.

The recipe follows AMD's PARD ("PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model Adaptation",
2025): the draft model keeps its architecture and learns to predict, at a run of mask tokens after the text, the
tokens 2, 3, .. K ahead. What it trains on, for a window x_0 .. x_{n-1} of the corpus:

* **Replicated segments.** Segment 0 is the window itself, causal, each position predicting the next token.
  Segment j (1 <= j < K) holds, for each anchor t, one mask token at position t + j that sees the real tokens
  x_0 .. x_t and the anchor's masks of segments 1 .. j (itself included) — exactly what the mask j positions after
  the text sees when serving — and predicts x_{t+j+1}. All segments run in one forward under one attention mask
  (a 4-D boolean mask and explicit position ids), so a window trains every anchor at every depth at once.
* **Conditional drop-out.** An anchor's mask of segment j is kept only when its mask of segment j − 1 was, each with
  probability ``keep``: a window costs about n (1 + keep + keep² + ..) tokens instead of n K, and every kept mask
  still sees the masks before it, as in serving. The draws are seeded by the window's tokens, so a resumed run draws
  the same.
* **Distillation.** Each kept token is pulled towards the frozen target's distribution at its position (position
  t + j predicts x_{t+j+1}): KL(target ‖ draft), as the shipped draft model was distilled. PARD's own recipe uses the
  corpus's next tokens; the target's law is what verification accepts.

The mask token is a token the text never holds: the byte-level token of a byte that no UTF-8 text contains (0xFF,
then the other invalid lead bytes), checked absent from the training and held-out streams (another tokenizer: its
highest unused id). The result is the same
model layout with ``pard_token`` and ``spd_type: "pard"`` in its ``config.json`` (float16 weights, as the shipped
draft), so ``--draft pard:DIR`` loads it here and vLLM's parallel drafting reads it unchanged. Before and after:
teacher-forced top-1 agreement with the target's greedy token at each block depth on held-out text, and the real
engine's mean accepted length (greedy chains of K).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from specserve import defaults
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM
from specserve.drafters.pard import SPD_TYPE, PardDrafter
from specserve.drafters.vocabulary import check_same_vocabulary
from specserve.training import heads as common
from specserve.training import loop

# Bytes no UTF-8 text holds (0xC0, 0xC1 and 0xF5 .. 0xFF), best first: their byte-level BPE tokens never occur in text.
INVALID_UTF8_BYTES = (0xFF, 0xFE, 0xFD, 0xFC, 0xFB, 0xFA, 0xF9, 0xF8, 0xF7, 0xF6, 0xF5, 0xC1, 0xC0)


@dataclass(frozen=True)
class PardRecipe:
    block_size: int = 4  # K: drafts per forward the model learns (segments 0 .. K - 1)
    keep: float = 0.7  # conditional drop-out: the chance an anchor's next deeper mask is kept
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 256
    peak_lr: float = 1e-3
    seed: int = 0
    max_tokens: int | None = None
    bf16_autocast: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise UserError(f"a PARD block drafts 2 or more tokens per forward; got --block-size {self.block_size}")
        if not 0 < self.keep <= 1:
            raise UserError(f"keep must be in (0, 1], got {self.keep}")


# ---------------------------------------------------------------------------------------------
# The mask token


def byte_level_char(byte: int) -> str:
    """The character byte-level BPE (GPT-2's table) writes for ``byte``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def choose_mask_token(tokenizer: Any, *streams: torch.Tensor) -> int:
    """The first of :data:`INVALID_UTF8_BYTES` whose byte-level token the vocabulary has and no stream holds; for a
    tokenizer that is not byte-level, the highest id that is no special token and that no stream holds."""
    seen = set(torch.cat([s.flatten() for s in streams]).unique().tolist()) if streams else set()
    vocab = tokenizer.get_vocab()
    for byte in INVALID_UTF8_BYTES:
        token = vocab.get(byte_level_char(byte))
        if token is not None and token not in seen:
            return int(token)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    unused = sorted(set(vocab.values()) - seen - special)
    if not unused:
        raise UserError("every token of the vocabulary occurs in the training text: none is free to be the mask token")
    return int(unused[-1])


# ---------------------------------------------------------------------------------------------
# Replicated segments


@dataclass(frozen=True)
class PardBatch:
    input_ids: torch.Tensor  # [B, L] the window's tokens, then the kept masks, then padding (the mask token)
    position_ids: torch.Tensor  # [B, L]
    attention: torch.Tensor  # [B, 1, L, L] bool: who each token sees
    source: torch.Tensor  # [B, L] the window position whose target law each token learns (0 for padding)
    valid: torch.Tensor  # [B, L] bool: real and mask tokens (not padding)
    depth: torch.Tensor  # [B, L] the token's segment j (0 = real; -1 for padding)


def pard_batch(windows: torch.Tensor, mask_token: int, block_size: int, keep: float, seed: int) -> PardBatch:
    """Every window [B, n] with its segments 1 .. block_size − 1 (conditional drop-out at ``keep``, drawn from
    ``seed``), padded to one length."""
    batch, n = windows.shape
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        anchor = torch.arange(n)
        segment = torch.zeros(n, dtype=torch.long)
        alive = torch.ones(n, dtype=torch.bool)
        for j in range(1, block_size):
            alive &= torch.rand(n, generator=generator) < keep
            alive[n - j :] = False  # position t + j must lie in the window (its target law is known)
            kept = alive.nonzero().flatten()
            anchor = torch.cat([anchor, kept])
            segment = torch.cat([segment, torch.full_like(kept, j)])
        rows.append((anchor, segment))
    length = max(a.numel() for a, _ in rows)
    input_ids = torch.full((batch, length), mask_token, dtype=torch.long)
    position_ids = torch.zeros((batch, length), dtype=torch.long)
    attention = torch.zeros((batch, 1, length, length), dtype=torch.bool)
    source = torch.zeros((batch, length), dtype=torch.long)
    depth = torch.full((batch, length), -1, dtype=torch.long)
    for b, (anchor, segment) in enumerate(rows):
        count = anchor.numel()
        input_ids[b, :n] = windows[b]
        position_ids[b, :count] = anchor + segment
        source[b, :count] = anchor + segment
        depth[b, :count] = segment
        same_anchor, earlier = anchor[None, :] == anchor[:, None], segment[None, :] <= segment[:, None]
        real_key = (segment == 0)[None, :] & (anchor[None, :] <= anchor[:, None])  # x_0 .. x_t of the query's anchor
        own_masks = (segment > 0)[None, :] & same_anchor & earlier  # the anchor's masks up to the query's depth
        attention[b, 0, :count, :count] = real_key | own_masks
        pad = torch.arange(count, length)
        attention[b, 0, pad, pad] = True  # padding sees itself only
    return PardBatch(input_ids, position_ids, attention, source, depth >= 0, depth)


def pard_loss(target: PreTrainedModel, mask_token: int, block_size: int, keep: float) -> loop.LossFn:
    """KL(target at each token's source position ‖ draft at the token), over the real and kept mask tokens."""

    def loss_fn(draft: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        windows = batch[:, :-1]
        seed = int(windows[:, :16].sum()) * 1_000_003 + int(windows[:, -16:].sum())  # the windows decide the draws
        built = pard_batch(windows, mask_token, block_size, keep, seed)
        with torch.no_grad():
            teacher = torch.log_softmax(target(input_ids=windows).logits.float(), dim=-1)  # [B, n, V]
        wanted = teacher.gather(1, built.source[..., None].expand(-1, -1, teacher.shape[-1]))  # [B, L, V]
        logits = draft(
            input_ids=built.input_ids, position_ids=built.position_ids, attention_mask=built.attention
        ).logits.float()
        student = torch.log_softmax(logits, dim=-1)
        kl = (wanted.exp() * (wanted - student)).sum(-1)  # [B, L]
        return kl[built.valid].mean()

    return loss_fn


@torch.inference_mode()
def teacher_forced(
    target: PreTrainedModel, draft: PreTrainedModel, mask_token: int, block_size: int, stream: torch.Tensor,
    seq_len: int = 128, windows: int = 8,
) -> list[float]:  # fmt: skip
    """On consecutive held-out windows, every anchor at every depth (no drop-out): how often the draft's top-1 at
    block depth j + 1 is the target's greedy token there, for j = 0 .. block_size − 1."""
    count = max(1, min(windows, (stream.numel() - 1) // seq_len))
    agree = torch.zeros(block_size, dtype=torch.float64)
    total = torch.zeros(block_size, dtype=torch.float64)
    for i in range(count):
        window = stream[i * seq_len : (i + 1) * seq_len][None]
        greedy = target(input_ids=window).logits[0].argmax(-1)  # [n]: the target's token after each position
        built = pard_batch(window, mask_token, block_size, 1.0, seed=0)
        logits = draft(
            input_ids=built.input_ids, position_ids=built.position_ids, attention_mask=built.attention
        ).logits[0]
        hits = logits.argmax(-1) == greedy[built.source[0]]
        for j in range(block_size):
            at = built.depth[0] == j
            agree[j] += hits[at].sum()
            total[j] += at.sum()
    return (agree / total.clamp(min=1)).tolist()


# ---------------------------------------------------------------------------------------------
# The recipe


def train_pard(
    target_dir: str | Path,
    out_dir: str | Path,
    recipe: PardRecipe = PardRecipe(),
    *,
    draft_dir: str | Path | None = None,
    data_folder: str | Path | None = None,
    checkpoint_every: int = 50,
    report_prompts: int = 4,
    report_tokens: int = 64,
) -> dict[str, Any]:
    """Adapt the draft model in ``draft_dir`` (default: the shipped one) to PARD for the target in ``target_dir`` and
    save it in ``out_dir`` (checkpoints in ``out_dir/checkpoints``: a rerun resumes). Returns the summary also
    written to ``training_summary.json``; the card goes to ``README.md``."""
    started = time.perf_counter()
    out = Path(out_dir)
    draft_dir = Path(draft_dir or defaults.DEFAULT_DRAFT)
    target = CausalLM.load(target_dir, dtype="float32")
    draft = CausalLM.load(draft_dir, dtype="float32")
    check_same_vocabulary(target, draft)
    if target.tokenizer is None:
        raise UserError(f"{target_dir} has no tokenizer; PARD training needs it to read text")
    teacher = common.frozen(target.model)
    train_stream, heldout_stream = common.token_streams(target.tokenizer, data_folder, recipe.max_tokens)
    if min(train_stream.numel(), heldout_stream.numel()) <= recipe.seq_len + 1:
        raise UserError(f"too little text for windows of {recipe.seq_len} tokens; lower --seq-len or give more data")
    mask = choose_mask_token(target.tokenizer, train_stream, heldout_stream)
    model = draft.model
    model.config.pard_token = mask
    model.config.spd_type = SPD_TYPE
    prompts = common.report_prompts(target, data_folder, heldout_stream, report_prompts, report_tokens)
    k = recipe.block_size

    def measure() -> dict[str, Any]:
        model.eval()
        drafter = PardDrafter(draft, mask, target)
        return {
            "top1_by_depth": teacher_forced(teacher, model, mask, k, heldout_stream),
            "chain": common.heldout_acceptance(target, drafter, prompts, report_tokens, gamma=k),
        }

    before = measure()
    cfg = loop.head_config(
        recipe.steps, recipe.batch_size, recipe.seq_len, recipe.peak_lr, recipe.seed, recipe.bf16_autocast
    )
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    run = loop.train(
        model, train_stream, pard_loss(teacher, mask, k, recipe.keep), cfg, desc="pard",
        checkpoint_dir=out / "checkpoints", checkpoint_every=checkpoint_every,
    )  # fmt: skip
    after = measure()
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    target.tokenizer.save_pretrained(out)
    summary: dict[str, Any] = {
        "kind": "pard",
        "target": str(target_dir),
        "base_draft": str(draft_dir),
        "pard_token": mask,
        "recipe": asdict(recipe),
        "parameters": sum(p.numel() for p in model.parameters()),
        "data": {
            "folder": None if data_folder is None else str(data_folder),
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
        },
        "train": run,
        "teacher_forced_top1_by_depth": {"base": before["top1_by_depth"], "trained": after["top1_by_depth"]},
        "heldout_acceptance": {"base draft": {"chain": before["chain"]}, "trained": {"chain": after["chain"]}},
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    summary["total_seconds"] = time.perf_counter() - started
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    top1 = " | ".join(
        f"{a:.3f} → **{b:.3f}**" for a, b in zip(before["top1_by_depth"], after["top1_by_depth"], strict=True)
    )
    body = f"""A PARD draft model (AMD, "PARD: Accelerating LLM Inference with Low-Cost PARallel Draft Model
Adaptation", 2025): `{draft_dir}` adapted to draft {k} tokens in one forward — the new tokens, then {k - 1} copies
of the mask token {mask} (`pard_token`; the byte-level token of a byte UTF-8 text never holds). A plain causal-LM
directory with `pard_token` and `spd_type: "pard"` in its `config.json`: `--draft pard:DIR` loads it here, vLLM's
parallel drafting reads the same fields.

Recipe (`specserve/training/pard.py`): replicated segments (every anchor of a window at every block depth in one
forward, each mask seeing the text up to its anchor and the masks before it), conditional drop-out (a deeper mask
kept with probability {recipe.keep} when the one before it was), distilled from the frozen target (KL(target ‖
draft) at every kept token); all weights trained, saved in float16.

Teacher-forced on held-out text, how often the draft's top-1 at block depth 1 .. {k} is the target's greedy token
(base draft → trained): {top1}."""
    common.write_head_card(out, summary, f"PARD draft model for `{target_dir}`", body)
    return summary
