"""One training loop for every model the project trains: random windows, AdamW, warmup + cosine, bf16 autocast
where the CPU multiplies bfloat16 natively (float32 elsewhere: the generic bf16 kernel is about 20x slower).

The loop knows nothing about what it trains; the caller passes a ``loss_fn(model, batch)``.
Pre-training uses next-token cross-entropy, distillation uses KL to the target's distribution, the
drafter heads (``specserve.training.eagle`` / ``medusa`` / ``exit_head``) their own losses on a
frozen target's features. Only ``model``'s trainable parameters are optimised.

With a ``checkpoint_dir`` the loop saves its whole state (trainable weights, optimizer, step, the
window sampler's random state, the running loss) every ``checkpoint_every`` steps and at the end,
and a later call with the same directory resumes from it: a run killed after a checkpoint and
resumed draws the same windows and ends with the same weights as an uninterrupted run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch_size: int = 16
    seq_len: int = 256
    peak_lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    bf16_autocast: bool = True


def cpu_bf16_is_native() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX tiles). Without, torch's bfloat16 matmuls
    fall back to a generic kernel: on this project's AVX2-only machine one EAGLE training step took 54 s under bf16
    autocast and 2.5 s in float32, so autocast is then skipped."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def head_config(
    steps: int, batch_size: int, seq_len: int, peak_lr: float, seed: int, bf16_autocast: bool
) -> TrainConfig:
    """The settings of a drafter-head run (EAGLE, Medusa, exit head): warmup a tenth of the steps, at most 40."""
    return TrainConfig(
        steps=steps, batch_size=batch_size, seq_len=seq_len, peak_lr=peak_lr, seed=seed,
        warmup_steps=min(40, max(1, steps // 10)), bf16_autocast=bf16_autocast,
    )  # fmt: skip


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``peak_lr`` then cosine decay to ``min_lr_ratio * peak_lr``."""
    if step < cfg.warmup_steps:
        return cfg.peak_lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.peak_lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def sample_windows(
    stream: torch.Tensor,  # [num_tokens]
    batch_size: int,
    seq_len: int,
    generator: torch.Generator,
) -> torch.Tensor:  # [batch_size, seq_len + 1]
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]


CHECKPOINT_FILE = "checkpoint.pt"


def train(
    model: torch.nn.Module,
    stream: torch.Tensor,  # [num_tokens] training token ids
    loss_fn: LossFn,
    cfg: TrainConfig,
    desc: str,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 100,
) -> dict[str, float]:
    """Train in place (resuming from ``checkpoint_dir`` when it holds a checkpoint of the same config);
    return {"final_loss", "seconds", "tokens", "resumed_from_step"}."""
    generator = torch.Generator().manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.peak_lr,
        betas=(0.9, 0.95),
    )
    ema_loss = float("nan")
    first_step = 0
    checkpoint = Path(checkpoint_dir) / CHECKPOINT_FILE if checkpoint_dir is not None else None
    if checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] != asdict(cfg):
            raise ValueError(
                f"{checkpoint} was written with another training config ({state['config']}); "
                "use a new checkpoint directory or the same settings"
            )
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"])
        first_step, ema_loss = int(state["step"]), float(state["ema_loss"])
    model.train()
    autocast = cfg.bf16_autocast and cpu_bf16_is_native()
    if cfg.bf16_autocast and not autocast:
        logger.info("this CPU has no native bfloat16 matmul (AVX512-BF16 or AMX): training in float32")
    start = time.perf_counter()
    bar = tqdm(
        range(first_step, cfg.steps), desc=desc, unit="step", dynamic_ncols=True, initial=first_step, total=cfg.steps
    )
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = sample_windows(stream, cfg.batch_size, cfg.seq_len, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        ema_loss = value if math.isnan(ema_loss) else 0.95 * ema_loss + 0.05 * value
        bar.set_postfix(loss=f"{ema_loss:.3f}", lr=f"{lr_at(step, cfg):.2e}")
        if checkpoint is not None and (step + 1 == cfg.steps or (step + 1) % checkpoint_every == 0):
            _save_checkpoint(checkpoint, model, optimizer, generator, step + 1, ema_loss, cfg)
    model.eval()
    seconds = time.perf_counter() - start
    return {
        "final_loss": ema_loss,
        "seconds": seconds,
        "tokens": float(cfg.steps * cfg.batch_size * cfg.seq_len),
        "resumed_from_step": float(first_step),
    }


def _save_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    generator: torch.Generator,
    step: int,
    ema_loss: float,
    cfg: TrainConfig,
) -> None:
    """The loop's whole state, written to a temporary file first so a kill never leaves a torn checkpoint."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    weights = {k: v for k, v in model.state_dict().items() if k in trainable}
    state = {
        "model": weights,
        "optimizer": optimizer.state_dict(),
        "generator": generator.get_state(),
        "step": step,
        "ema_loss": ema_loss,
        "config": asdict(cfg),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    torch.save(state, partial)
    partial.replace(path)


def next_token_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def distillation_loss(teacher: torch.nn.Module) -> LossFn:
    """KL(teacher || student) per position, averaged: the student learns the teacher's whole distribution."""

    def loss_fn(student: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher_logp = torch.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
        student_logp = torch.log_softmax(student(input_ids=inputs).logits.float(), dim=-1)
        kl = (teacher_logp.exp() * (teacher_logp - student_logp)).sum(-1)
        return kl.mean()

    return loss_fn


@torch.inference_mode()
def heldout_loss(model: torch.nn.Module, stream: torch.Tensor, seq_len: int = 256, max_windows: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over consecutive held-out windows, in float32."""
    model.eval()
    n = min(max_windows, (stream.numel() - 1) // seq_len)
    total = 0.0
    for i in range(n):
        window = stream[i * seq_len : (i + 1) * seq_len + 1][None]
        logits = model(input_ids=window[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], window[0, 1:]).item()
    return total / n
