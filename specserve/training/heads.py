"""What every drafter-head training shares: a frozen target, its features, token streams, the acceptance report.

The heads trained here (EAGLE, Medusa, the layer-skip exit head) all learn from a frozen target's
hidden states (:func:`target_features`, with the serving definition
:func:`~specserve.core.model.causal_lm.select_features`) and are judged the same way: by running the real
speculative engine on held-out prompts (:func:`heldout_acceptance`) rather than by a proxy.
Token streams come from the default corpus (the standard library) or a user's folder of text or
code (:func:`token_streams`). Does not define any head or loss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from transformers import PreTrainedModel

from specserve.core.draft.drafter import Drafter
from specserve.core.engine import SpeculativeEngine
from specserve.core.errors import UserError
from specserve.core.model.causal_lm import CausalLM, select_features
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.stats import RequestStats
from specserve.core.tree.shapes import TreeSpec
from specserve.training import corpus

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java", ".json", ".toml")


def frozen(model: PreTrainedModel) -> PreTrainedModel:
    """``model`` in eval mode with every parameter frozen (the target is never trained here)."""
    model.eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    return model


@torch.no_grad()
def target_features(target: PreTrainedModel, input_ids: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
    """The target's features ``[batch, seq, len(layers) * hidden]`` of ``input_ids`` ``[batch, seq]``."""
    out = target(input_ids=input_ids, output_hidden_states=True, logits_to_keep=1)
    return select_features(out.hidden_states, layers)


def output_head(target: PreTrainedModel) -> torch.nn.Module:
    """The target's (frozen) LM head: the final hidden state (after the final norm) -> logits."""
    head = target.get_output_embeddings()
    if not isinstance(head, torch.nn.Module):
        raise UserError(f"{type(target).__name__} has no output embeddings (LM head)")
    return head


def folder_files(folder: str | Path) -> list[corpus.SourceFile]:
    """Every non-empty text/code file under ``folder`` (by suffix, see ``TEXT_SUFFIXES``), sorted by path."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"training data folder {root} does not exist or is not a directory")
    files = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(corpus.SourceFile(path.relative_to(root).as_posix(), text))
    if not files:
        raise UserError(f"no text files ({', '.join(TEXT_SUFFIXES)}) found under {root}")
    return files


def token_streams(
    tokenizer: Any, folder: str | Path | None = None, max_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) token streams: every file's ids followed by EOS, at most ``max_tokens`` each.

    The default corpus has its fixed split; a user's folder is split the same stable way (by a hash of
    each file's path), and when that holds out no file, the last 5 % of the train stream is held out."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UserError("the target's tokenizer has no EOS token to separate files with")
    if folder is None:
        splits = {split: corpus.load_corpus(split) for split in ("train", "heldout")}
    else:
        files = folder_files(folder)
        splits = {split: [f for f in files if corpus.split_of(f.relpath) == split] for split in ("train", "heldout")}
    streams = {split: _encode(tokenizer, files, eos, split, max_tokens) for split, files in splits.items()}
    train, heldout = streams["train"], streams["heldout"]
    if heldout.numel() == 0 or train.numel() == 0:
        whole = torch.cat([train, heldout])
        cut = max(1, whole.numel() // 20)
        train, heldout = whole[:-cut], whole[-cut:]
    return train, heldout


def _encode(
    tokenizer: Any, files: list[corpus.SourceFile], eos: int, split: str, max_tokens: int | None
) -> torch.Tensor:
    ids: list[int] = []
    for start in tqdm(range(0, len(files), 256), desc=f"tokenize {split}", unit="batch", leave=False):
        for row in tokenizer([f.text for f in files[start : start + 256]])["input_ids"]:
            ids.extend(row)
            ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


def heldout_acceptance(
    target: CausalLM,
    drafter: Drafter,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int = 64,
    gamma: int = 4,
    tree: TreeSpec | None = None,
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Run the real speculative engine on ``prompts``: mean accepted length (tokens per target pass) and
    acceptance by draft position, greedy unless ``temperature`` says otherwise (seed = prompt index)."""
    engine = SpeculativeEngine(target, drafter)
    config = GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma, tree=tree, ignore_eos=True)
    total = RequestStats()
    for seed, prompt in enumerate(prompts):
        total.merge(engine.generate(prompt, SamplingParams(temperature=temperature, seed=seed), config).stats)
    return {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "gamma": gamma if tree is None else None,
        "tree": None if tree is None else tree.describe(),
        "cycles": total.cycles,
        "mean_accepted_length": total.mean_accepted,
        "acceptance_by_depth": total.acceptance_by_position,
        "drafted_tokens": total.drafted_tokens,
        "accepted_tokens": total.accepted_tokens,
    }


def report_prompts(
    target: CausalLM, folder: str | Path | None, heldout: torch.Tensor, count: int, new_tokens: int
) -> list[str] | list[list[int]]:
    """Prompts for the held-out acceptance report: the benchmark's held-out prompts for the default target on
    the default corpus; else ``count`` evenly spaced held-out openings of up to 128 tokens (fewer when the
    target's context, less ``new_tokens``, or the held-out text is short)."""
    from specserve.defaults import DEFAULT_TARGET

    if folder is None and Path(target.info.path).resolve() == DEFAULT_TARGET.resolve():
        return corpus.heldout_prompts(count)
    stride = heldout.numel() // max(count, 1)
    length = max(1, min(128, target.info.max_positions - new_tokens, stride))
    return [heldout[i * stride : i * stride + length].tolist() for i in range(count)]


def write_head_card(out: str | Path, summary: dict[str, Any], title: str, body: str) -> None:
    """``README.md`` of a trained head: what it is, its target, its recipe and its held-out acceptance."""
    lines = [f"# {title}", "", f"Target: `{summary['target']}`", "", body.strip(), "", "## Held-out acceptance", ""]
    lines += ["Greedy, the real speculative engine; mean accepted length = tokens committed per target pass.", ""]
    lines += ["| | drafting | mean accepted length | acceptance by depth |", "|---|---|---|---|"]
    for stage, reports in summary["heldout_acceptance"].items():
        for report in reports.values():
            shape = report["tree"] or f"chain γ {report['gamma']}"
            by_depth = ", ".join("-" if a is None else f"{a:.2f}" for a in report["acceptance_by_depth"][:8])
            lines.append(f"| {stage} | {shape} | {report['mean_accepted_length']:.2f} | {by_depth} |")
    lines += ["", f"{report['prompts']} held-out prompts, {report['max_new_tokens']} new tokens each."]
    lines += ["", "## Recipe", "", "```json", json.dumps(summary["recipe"], indent=2), "```", ""]
    train = summary.get("train", {})
    if train:
        lines.append(
            f"Trained {summary['recipe'].get('steps')} steps in {train.get('seconds', 0.0) / 60:.1f} min on this "
            f"machine's CPU (final loss {train.get('final_loss', float('nan')):.3f}); "
            f"{summary.get('parameters', 0):,} trainable parameters."
        )
    earlier = summary.get("init_from")
    while earlier:  # a continuation: the runs the starting head came from
        run, recipe = earlier.get("train") or {}, earlier.get("recipe") or {}
        lines.append(
            f"Continued from `{earlier['path']}`, itself trained {recipe.get('steps')} steps "
            f"({run.get('seconds', 0.0) / 60:.1f} min, final loss {run.get('final_loss', float('nan')):.3f})."
        )
        earlier = earlier.get("init_from")
    recipe = summary.get("recipe") or {}
    kind, target = summary["kind"], summary["target"]
    command = _train_command(kind, target, recipe)
    if summary.get("init_from"):
        earlier = summary["init_from"]
        command = (
            f"{_train_command(kind, target, earlier.get('recipe') or {})}` (the run it continued from), then "
            f"`specserve train {kind} --target {target} {_layout_flags(recipe)}--init-from {earlier['path']} "
            f"--steps {recipe.get('steps')} --seed {recipe.get('seed')}"
        )
    lines += ["", f"Reproduce: `{command}` (rerun a run to resume it)."]
    Path(out, "README.md").write_text("\n".join(lines) + "\n")


def _layout_flags(recipe: dict[str, Any]) -> str:
    """The flags of a recipe in the published EAGLE-3 layout (not the default one), each followed by a space."""
    if recipe.get("layout") != "eagle3":
        return ""
    return (
        f"--layout eagle3 --draft-vocab {recipe.get('draft_vocab')} "
        f"--speculative-tokens {recipe.get('speculative_tokens')} "
    )


def _train_command(kind: str, target: str, recipe: dict[str, Any]) -> str:
    """The command that trains a head with ``recipe`` from scratch (its steps named for the published layout)."""
    flags = _layout_flags(recipe)
    command = f"specserve train {kind} --target {target}"
    return f"{command} {flags}--steps {recipe.get('steps')}" if flags else command
