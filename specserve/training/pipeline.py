"""`specserve train`: build the shipped default pair end to end and write its model card.

Steps: read the standard library (corpus.py) -> train the byte-level BPE tokenizer -> pre-train
the Llama target -> distill the draft from it (KL to the target's distribution) -> measure
held-out loss and teacher-forced acceptance alpha -> save both as HF checkpoint directories in
half precision with the tokenizer beside each, plus ``README.md`` (the model card) and
``training_summary.json``. Every random choice is seeded.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from specserve.training import card, corpus, loop, model_configs
from specserve.training.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer


@dataclass(frozen=True)
class RecipeConfig:
    out_dir: Path = Path("models")
    vocab_size: int = 8192
    target_steps: int = 1000
    draft_steps: int = 500
    batch_size: int = 16
    seq_len: int = 256
    seed: int = 0


def eos_id(tokenizer: PreTrainedTokenizerFast) -> int:
    token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    assert isinstance(token_id, int)
    return token_id


def encode_stream(tokenizer: PreTrainedTokenizerFast, files: list[corpus.SourceFile]) -> torch.Tensor:
    """Concatenate all files as token ids, each followed by EOS."""
    eos = eos_id(tokenizer)
    ids: list[int] = []
    batch = 256
    for i in tqdm(range(0, len(files), batch), desc="tokenize", unit="batch"):
        for row in tokenizer([f.text for f in files[i : i + batch]])["input_ids"]:
            ids.extend(row)
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@torch.inference_mode()
def teacher_forced_alpha(
    target: torch.nn.Module, draft: torch.nn.Module, stream: torch.Tensor, seq_len: int = 256, windows: int = 32
) -> dict[str, float]:
    """Per-token acceptance on held-out text: greedy (argmax agreement) and temperature 1 (sum min(p, q))."""
    n = min(windows, (stream.numel() - 1) // seq_len)
    greedy, sampled = 0.0, 0.0
    for i in range(n):
        window = stream[i * seq_len : (i + 1) * seq_len][None]
        target_probs = torch.softmax(target(input_ids=window).logits.float()[0], -1)
        draft_probs = torch.softmax(draft(input_ids=window).logits.float()[0], -1)
        greedy += (target_probs.argmax(-1) == draft_probs.argmax(-1)).float().mean().item()
        sampled += torch.minimum(target_probs, draft_probs).sum(-1).mean().item()
    return {"greedy": greedy / n, "temperature_1": sampled / n}


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(str(out), safe_serialization=True)
    model.float()
    save_tokenizer(tokenizer, out)


def run(cfg: RecipeConfig) -> dict[str, object]:
    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    train_files = corpus.load_corpus("train")
    heldout_files = corpus.load_corpus("heldout")
    print(f"corpus: {len(train_files)} train files, {len(heldout_files)} held-out files")

    tokenizer = train_tokenizer((f.text for f in train_files), vocab_size=cfg.vocab_size)
    eos = eos_id(tokenizer)
    train_stream = encode_stream(tokenizer, train_files)
    heldout_stream = encode_stream(tokenizer, heldout_files)
    print(f"tokens: {train_stream.numel():,} train, {heldout_stream.numel():,} held-out")

    vocab = len(tokenizer)
    target = LlamaForCausalLM(model_configs.target_config(vocab, eos))
    target_cfg = loop.TrainConfig(steps=cfg.target_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed)
    target_run = loop.train(target, train_stream, loop.next_token_loss, target_cfg, desc="target")
    for p in target.parameters():
        p.requires_grad_(False)

    torch.manual_seed(cfg.seed + 1)
    draft = LlamaForCausalLM(model_configs.draft_config(vocab, eos))
    draft_cfg = loop.TrainConfig(
        steps=cfg.draft_steps, batch_size=cfg.batch_size, seq_len=cfg.seq_len, seed=cfg.seed + 1, peak_lr=2e-3
    )
    draft_run = loop.train(draft, train_stream, loop.distillation_loss(target), draft_cfg, desc="draft (distill)")

    target_loss = loop.heldout_loss(target, heldout_stream)
    draft_loss = loop.heldout_loss(draft, heldout_stream)
    alpha = teacher_forced_alpha(target, draft, heldout_stream)

    prompt = heldout_files[0].text[:200]
    prompt_ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        cont = target.generate(prompt_ids, max_new_tokens=64, do_sample=False, pad_token_id=eos)
    sample = tokenizer.decode(cont[0, prompt_ids.shape[1] :])

    _save(target, tokenizer, cfg.out_dir / "target")
    _save(draft, tokenizer, cfg.out_dir / "draft")

    summary: dict[str, object] = {
        "recipe": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "corpus": {
            "train_files": len(train_files),
            "heldout_files": len(heldout_files),
            "train_tokens": int(train_stream.numel()),
            "heldout_tokens": int(heldout_stream.numel()),
        },
        "target": {
            "parameters": sum(p.numel() for p in target.parameters()),
            "heldout_loss_nats": target_loss,
            "train": target_run,
            "train_config": asdict(target_cfg),
        },
        "draft": {
            "parameters": sum(p.numel() for p in draft.parameters()),
            "heldout_loss_nats": draft_loss,
            "train": draft_run,
            "train_config": asdict(draft_cfg),
        },
        "teacher_forced_alpha": alpha,
        "sample": {"prompt": prompt, "greedy_continuation": sample},
        "total_seconds": time.perf_counter() - t0,
    }
    (cfg.out_dir / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    card.write_card(cfg.out_dir)
    print(json.dumps({k: summary[k] for k in ("teacher_forced_alpha", "total_seconds")}))
    return summary
