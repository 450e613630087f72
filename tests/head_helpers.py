"""Heads for the tiny targets, shared by the drafter, batched-engine and distributed tests: a trained EAGLE head
per target (trained once per test run) and Medusa heads with random weights; and :func:`check_tree_logits`, which
holds a feature head's drafts at every node of a tree against a reference forward."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from conftest import TinyPair, build_model
from filelock import FileLock

from specserve.core.model.causal_lm import CausalLM, select_features
from specserve.core.sampling.params import SamplingParams
from specserve.core.tree.shapes import ROOT
from specserve.drafters.eagle_head import EagleConfig, EagleHead
from specserve.drafters.medusa import MedusaHeads
from specserve.training import loop
from specserve.training.eagle import EagleRecipe, train_head
from specserve.training.medusa import heads_for

RECIPE = EagleRecipe(unroll=2, steps=400, batch_size=8, seq_len=24, peak_lr=3e-3, checkpoint_every=1000)


def target_stream(target: CausalLM, tokens: int = 3000, seed: int = 0) -> torch.Tensor:
    """Text the target itself writes, half sampled at T = 1 and half greedy: what a head must learn to predict."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, target.info.vocab_size, (tokens // 192, 4), generator=generator)
    rows = []
    with torch.inference_mode():
        torch.manual_seed(seed)
        for sampled in (True, False):
            kwargs = {"do_sample": True, "top_k": 0} if sampled else {"do_sample": False}
            rows.append(target.model.generate(ids, max_new_tokens=92, pad_token_id=0, **kwargs))
    return torch.cat([row.reshape(-1) for row in rows])


_HEADS: dict[str, EagleHead] = {}

SHARED_DIR = "SPECSERVE_TEST_CACHE"
"""A directory the processes of one test run share (``make pytest`` makes one for both tiers and their xdist
workers): a trained head is saved there by the first process that needs it, and loaded by the others."""

TRAINING_CODE = ("specserve/training/eagle.py", "specserve/drafters/eagle.py", "specserve/drafters/eagle_head.py")


def trained_head(pair: TinyPair) -> EagleHead:
    """One head per family, trained once per test run: by this process, or loaded from the run's shared directory
    (:data:`SHARED_DIR`) where another process of the run saved it, under a key of everything it depends on."""
    if pair.family not in _HEADS:
        shared = os.environ.get(SHARED_DIR)
        if not shared:
            _HEADS[pair.family] = _train(pair)
        else:
            directory = Path(shared) / f"eagle-{pair.family}-{_fingerprint(pair)}"
            with FileLock(f"{directory}.lock"):
                if not directory.is_dir():
                    _train(pair).save(directory)
                _HEADS[pair.family] = EagleHead.load(directory)
    return _HEADS[pair.family]


def _train(pair: TinyPair) -> EagleHead:
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(pair.target.model)).double()
    train_head(head, pair.target.model, target_stream(pair.target), RECIPE, None)
    return head.eval()


def _fingerprint(pair: TinyPair) -> str:
    """What a trained head depends on: the target's weights, the recipe and the training and head code."""
    digest = hashlib.sha256(repr(RECIPE).encode())
    for name, tensor in sorted(pair.target.model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    root = Path(__file__).resolve().parents[1]
    for path in TRAINING_CODE:
        digest.update((root / path).read_bytes())
    return digest.hexdigest()[:16]


def random_heads(target: CausalLM, seed: int = 0, num_heads: int = 3, std: float = 0.05) -> MedusaHeads:
    """Medusa heads with random (non-zero) weights: their drafts are right sometimes, wrong sometimes."""
    heads = heads_for(target.model, num_heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.copy_(std * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return heads


# a tree grown level by level: node ids, their tokens and parents (depths 0, 0 | 1, 1, 1 | 2 | 3)
TREE_LEVELS = [[0, 1], [2, 3, 4], [5], [6]]
TREE_TOKENS = [11, 40, 13, 70, 15, 16, 90]
TREE_PARENTS = [ROOT, ROOT, 0, 0, 1, 2, 5]
CONTEXT = [5, 17, 23, 8, 9, 30, 31]


def check_tree_logits(
    drafter: Any,  # an EagleDrafter
    target: CausalLM,
    reference: Callable[[Sequence[int], Sequence[int]], torch.Tensor],
    **tolerance: float,
) -> torch.Tensor:
    """The drafter's logits at the root and at every node of a tree (depths 0-3) after 5 committed tokens, then again
    after two more (a catch-up block), each equal to ``reference(committed, path)`` (the logits after the drafted
    ``path``) within ``tolerance``; returns the last root's logits."""
    with torch.inference_mode():
        out = target.model(torch.tensor([CONTEXT]), output_hidden_states=True)
        raw = select_features([h[0] for h in out.hidden_states], drafter.feature_layers)
    drafter.start(CONTEXT[:5], SamplingParams(), torch.Generator())
    drafter.add_features(0, raw[:4])
    root = torch.empty(0)
    for committed in (CONTEXT[:5], CONTEXT):
        if len(committed) > 5:
            drafter.accept(CONTEXT[5:])
            drafter.add_features(4, raw[4:6])
        session = drafter._open_session()
        root = reference(committed, [])
        torch.testing.assert_close(session.root_logits, root, **tolerance)
        for level in TREE_LEVELS:
            logits = session.expand(level, TREE_TOKENS, TREE_PARENTS)
            for row, node in enumerate(level):
                path: list[int] = []
                while node != ROOT:
                    path.insert(0, TREE_TOKENS[node])
                    node = TREE_PARENTS[node]
                torch.testing.assert_close(logits[row], reference(committed, path), **tolerance)
        session.close()
    return root


def periodic(length: int, offset: int = 0) -> torch.Tensor:
    return (torch.arange(offset, offset + length) * 7 % 31) + 3  # tokens 3 .. 33 in a fixed order


def trained_target() -> CausalLM:
    """A tiny target that has learnt the periodic stream: what it says next is predictable, as in real text."""
    model = build_model("llama", seed=2)
    cfg = loop.TrainConfig(steps=60, batch_size=8, seq_len=32, peak_lr=1e-2, warmup_steps=4, bf16_autocast=False)
    loop.train(model, periodic(3000), loop.next_token_loss, cfg, desc="tiny target")
    return CausalLM(model)


def save_pard(source: Path, where: Path, **fields: object) -> Path:
    """The draft checkpoint at ``source`` copied to ``where`` with ``fields`` added to its config (a PARD checkpoint
    as published: ``pard_token=.., spd_type="pard"``)."""
    shutil.copytree(source, where)
    config = json.loads((where / "config.json").read_text())
    config.update(fields)
    (where / "config.json").write_text(json.dumps(config))
    return where
