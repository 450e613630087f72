"""Writes ``models/README.md``, the model card of the default pair, from ``training_summary.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def render(summary: dict[str, Any]) -> str:
    recipe, corpus = summary["recipe"], summary["corpus"]
    target, draft, alpha = summary["target"], summary["draft"], summary["teacher_forced_alpha"]
    tcfg, dcfg = target["train_config"], draft["train_config"]
    sample = summary["sample"]
    notes = "".join(f"- {note}\n" for note in summary.get("notes", []))
    return f"""# specserve default model pair

Two Llama-architecture causal LMs sharing one byte-level BPE tokenizer, trained from scratch on
the Python {summary["python"]} standard library sources by `specserve train` (torch {summary["torch"]},
2-core CPU, bf16 autocast). They exist so that everything in specserve runs with no arguments on a
machine that cannot download weights. They are small code models: useful for measuring
speculative decoding, not for writing your code.

| | target (`models/target`) | draft (`models/draft`) |
|---|---|---|
| architecture | Llama, 8 layers x 512, 8 query / 2 KV heads (GQA), SwiGLU 1408, tied embeddings | Llama, 1 layer x 256, 4 query / 2 KV heads, SwiGLU 704, tied embeddings |
| parameters | {target["parameters"]:,} | {draft["parameters"]:,} |
| context | 1024 tokens | 1024 tokens |
| training | next-token cross-entropy, {tcfg["steps"]} steps x {tcfg["batch_size"]}x{tcfg["seq_len"]} tokens | distilled from the target: KL(target ‖ draft), {dcfg["steps"]} steps x {dcfg["batch_size"]}x{dcfg["seq_len"]} |
| optimiser | AdamW (0.9, 0.95), wd {tcfg["weight_decay"]}, peak LR {tcfg["peak_lr"]}, {tcfg["warmup_steps"]} warmup steps, cosine to {tcfg["min_lr_ratio"]}x | same, peak LR {dcfg["peak_lr"]} |
| wall time | {target["train"]["seconds"] / 60:.1f} min | {draft["train"]["seconds"] / 60:.1f} min |
| held-out loss (nats/token) | **{target["heldout_loss_nats"]:.3f}** | **{draft["heldout_loss_nats"]:.3f}** |
| weights on disk | float16 safetensors | float16 safetensors |

- **Corpus**: every `.py` file of the standard library except test suites and site-packages;
  files are split by a stable SHA-256 hash of their relative path: {corpus["train_files"]} train files
  ({corpus["train_tokens"]:,} tokens), {corpus["heldout_files"]} held-out files ({corpus["heldout_tokens"]:,} tokens).
- **Tokenizer**: byte-level BPE, {recipe["vocab_size"]} entries, one special token `<|endoftext|>` (BOS = EOS = PAD).
- **Seed**: {recipe["seed"]} (target), {recipe["seed"] + 1} (draft); data windows are drawn from a seeded generator.
- **Acceptance α of the draft** (teacher-forced on held-out text, per token): greedy argmax
  agreement **{alpha["greedy"]:.3f}**, temperature 1 Σ min(p, q) **{alpha["temperature_1"]:.3f}**. The α that
  the engine actually reaches per draft position is measured by `specserve bench` (BENCHMARKS.md).
- **Total recipe time**: {summary["total_seconds"] / 60:.1f} min on this machine.

Reproduce: `make train` (or `specserve train --out models --target-steps {tcfg["steps"]} --draft-steps {dcfg["steps"]}`).

## Drafter heads trained for this target

Each directory has its own card (`README.md`) and `training_summary.json`; the target stays frozen.

| directory | drafter | load with | train with |
|---|---|---|---|
| `models/eagle` | EAGLE-3 head in the published (SafeAILab) layout: the inputs of layers 2 / 4 / 5, one decoder layer, a 6,144-token draft vocabulary, training-time test | `--draft eagle:models/eagle` | `specserve train eagle --layout eagle3 --draft-vocab 6144` |
| `models/medusa` | 4 Medusa heads on the last hidden state | `--draft medusa:models/medusa` | `specserve train medusa` |
| `models/exit-head` | layer-skip exit head after layer 4 | `--draft layerskip:models/exit-head` | `specserve train exit-head --layers 4` |

## Retrieval datastore (REST)

`make datastore` builds `runs/datastore/stdlib.rest` for `--draft rest:FILE` from the same training files
with the target's tokenizer (`specserve datastore build`): 3,028,961 tokens from 693 files, 23.1 MiB
(tokens and suffix array, memory-mapped), built in 17.9 s on the 2-core CPU (BENCHMARKS.md §12). It is built,
not shipped: the file is larger than the models.

## Limitations

- Greedy decoding of a model this small repeats itself (see the sample below). Repetitive text
  flatters drafters, n-gram lookup most of all, so BENCHMARKS.md reports temperature 1 beside greedy.
- The target saw {target["train"]["tokens"] / 1e6:.1f}M training tokens ({target["train"]["tokens"] / corpus["train_tokens"]:.2f} epochs), what a 2-core CPU
  affords in about an hour. Its held-out loss ({target["heldout_loss_nats"]:.2f}) sits above the final training loss
  ({target["train"]["final_loss"]:.2f}, a moving average over training batches): held-out files are whole modules it never saw.
{notes}
## Sample

Greedy continuation by the target of the opening of a held-out file:

````text
{sample["prompt"]}
````

continues with

````text
{sample["greedy_continuation"]}
````
"""


def write_card(out_dir: Path) -> Path:
    summary = json.loads((out_dir / "training_summary.json").read_text())
    path = out_dir / "README.md"
    path.write_text(render(summary))
    return path
