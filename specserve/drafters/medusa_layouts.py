"""Reading published Medusa heads unchanged: which layout a directory is in, its tensors checked, its own LM heads.

specserve's own heads (``"specserve_drafter": "medusa"``) are read by :class:`~specserve.drafters.medusa.MedusaHeads`.
This module reads the two published layouts, with no conversion step (docs/published-heads.md §4):

* **FasterDecoding/Medusa** (``medusa/model/medusa_model.py``): ``config.json`` with ``medusa_num_heads`` K,
  ``medusa_num_layers`` n (default 1) and ``base_model_name_or_path``; tensors, with no prefix,
  ``{i}.{j}.linear.weight [H, H]`` and ``{i}.{j}.linear.bias [H]`` for j < n, then ``{i}.{n}.weight [V, H]``, head
  i's own LM head. The reference builds each head from one residual block repeated n times (shared weights) yet its
  state dict lists every index: each index is loaded as stored, so copies that differ (never written by the
  reference itself) give what the file says, where the reference would use its last copy for every block (a
  warning is logged).
* **vLLM** (``vllm/model_executor/models/medusa.py``): ``"model_type": "medusa"`` or ``"architectures":
  ["MedusaModel"]``; ``hidden_size``, ``vocab_size``, ``num_heads`` (or ``medusa_num_heads``), ``num_hidden_layers``
  (or ``medusa_num_layers``), each defaulting as vLLM's config class does; ``truncated_vocab_size`` (default
  ``vocab_size``), ``medusa_fc_bias`` (default false), ``original_lm_head`` (one LM head shared by every head) and
  ``logit_scale`` (logits multiplied by it, as vLLM's logits processor does; only a positive finite value is
  accepted). Tensors ``blocks.{i}.layers.{j}.weight [H, H]`` (and ``.bias`` with ``medusa_fc_bias``),
  ``lm_heads.{i}.weight`` (a single ``lm_head.weight`` or ``lm_heads.0.weight`` with ``original_lm_head``) of
  ``truncated_vocab_size`` rows, or of ``vocab_size`` rows then cut to ``token_map``'s, as vLLM does; ``token_map``
  ``[truncated_vocab_size]`` (distinct target ids, required when the vocabulary is truncated, ignored otherwise as
  vLLM ignores it): draft row r is target token ``token_map[r]`` and every other token gets logit -inf. A leading
  ``medusa_heads.`` is stripped from every name.

The layout comes from ``config.json`` (vLLM's ``model_type`` / architecture; otherwise ``medusa_num_heads``), the
tensor names deciding a config both could hold. Weights are read from ``medusa_lm_head.safetensors``,
``medusa_lm_head.pt``, ``model.safetensors`` (or its shards) or ``pytorch_model.bin``; a pickle is loaded with
``weights_only`` (one carrying code is refused and nothing in it runs). Every tensor is checked by name and shape
against the target's hidden size and vocabulary before anything loads: a missing, extra or misshapen tensor, heads
for another target or a malformed field are refused with one line of :class:`InvalidMedusaHeads` saying what to do.

Does not read specserve's own layout, build the heads or the drafter (:mod:`specserve.drafters.medusa`), or write
any layout.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specserve.core.errors import UserError
from specserve.drafters.head_files import PICKLE_FILE, SHARDED_INDEX, WEIGHTS_FILE, read_pickle, read_weights

logger = logging.getLogger(__name__)

TRAIN_HINT = "train heads for it with `specserve train medusa`"
FASTERDECODING = "FasterDecoding/Medusa"
VLLM = "vLLM Medusa"
MEDUSA_SAFETENSORS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
VLLM_PREFIX = "medusa_heads."
# vLLM's MedusaConfig defaults (vllm/transformers_utils/configs/medusa.py)
VLLM_DEFAULTS = {"hidden_size": 4096, "vocab_size": 32001, "num_heads": 5, "num_hidden_layers": 1}
_FD_NAME = re.compile(r"\d+\.\d+\.")


class InvalidMedusaHeads(UserError):
    """A Medusa heads directory is missing, malformed, or was trained for another target; the message says which."""


def is_published(config: Mapping[str, Any]) -> bool:
    """Whether a ``config.json`` names a published Medusa layout (and not specserve's own)."""
    return "specserve_drafter" not in config and (_names_vllm(config) or "medusa_num_heads" in config)


def _names_vllm(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "medusa" or "MedusaModel" in (config.get("architectures") or [])


class OwnLMHeads(torch.nn.Module):
    """Published heads' own LM heads: their hidden states ``[..., K, H]`` -> logits over the target's vocabulary
    ``[..., K, V]``. ``weight`` is ``[K, V_d, H]`` (``[1, V_d, H]`` when every head shares one); with a
    ``token_map`` (``[V_d]`` target ids) the ``V_d`` logits are scattered into ``V`` and every other token gets
    -inf (probability exactly 0); ``logit_scale`` multiplies the logits first."""

    token_map: torch.Tensor | None

    def __init__(
        self,
        weight: torch.Tensor,
        vocab_size: int,
        layout: str,
        token_map: torch.Tensor | None = None,
        scale: float = 1,
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.register_buffer("token_map", token_map)
        self.vocab_size = vocab_size
        self.layout = layout
        self.logit_scale = float(scale)

    @property
    def draft_vocab(self) -> int:
        """How many tokens can get a finite logit."""
        return int(self.weight.shape[1])

    def fits(self, num_heads: int, hidden_size: int, vocab_size: int) -> bool:
        return (
            int(self.weight.shape[0]) in (1, num_heads)
            and int(self.weight.shape[2]) == hidden_size
            and self.vocab_size == vocab_size
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., K, H] -> [..., K, V]
        if self.weight.shape[0] == 1:  # one LM head for every head (never broadcast: that would copy it K times)
            logits = hidden @ self.weight[0].T
        else:  # head k's rows through LM head k, batched over k
            logits = torch.einsum("...kh,kvh->...kv", hidden, self.weight)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.token_map is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.vocab_size), float("-inf"))
        full[..., self.token_map] = logits
        return full


@dataclass(frozen=True)
class PublishedMedusa:
    """Published heads, checked: their shape, the residual blocks under
    :class:`~specserve.drafters.medusa.MedusaHeads`' names (a zero bias where the layout has none) and their own LM
    heads."""

    layout: str
    num_heads: int
    layers_per_head: int
    blocks: dict[str, torch.Tensor]  # heads.{i}.{j}.linear.weight / .bias
    lm_heads: OwnLMHeads
    trained_for: str  # the base model a FasterDecoding config names ("" when none)


def read_published(
    directory: str | Path, config: Mapping[str, Any], hidden_size: int, vocab_size: int, target_name: str
) -> PublishedMedusa:
    """The published heads in ``directory`` (whose parsed ``config.json`` is ``config``) for a target of
    ``hidden_size`` and ``vocab_size`` (``target_name`` names it in messages); :class:`InvalidMedusaHeads` in one
    line for anything that does not fit."""
    path = Path(directory)
    state, source = read_published_weights(path)
    if _names_vllm(config):
        return _vllm(path, config, state, source, hidden_size, vocab_size, target_name)
    stripped = _strip(state)
    if any(name.startswith(("blocks.", "lm_heads.")) for name in stripped) and not any(
        _FD_NAME.match(name) for name in state
    ):
        return _vllm(path, config, state, source, hidden_size, vocab_size, target_name)  # vLLM names, FD config keys
    return _fasterdecoding(path, config, state, source, hidden_size, vocab_size, target_name)


def read_published_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of a published heads directory, on the CPU in its stored dtype, and the file it came from."""
    if (path / MEDUSA_SAFETENSORS).is_file():
        try:
            return load_file(str(path / MEDUSA_SAFETENSORS)), path / MEDUSA_SAFETENSORS
        except (SafetensorError, OSError) as exc:
            raise InvalidMedusaHeads(f"{path / MEDUSA_SAFETENSORS} is not a readable safetensors file: {exc}") from exc
    if (path / MEDUSA_PICKLE).is_file():
        fix = f"use the heads' {MEDUSA_SAFETENSORS} instead"
        return read_pickle(path / MEDUSA_PICKLE, InvalidMedusaHeads, fix), path / MEDUSA_PICKLE
    if not any((path / name).is_file() for name in (WEIGHTS_FILE, SHARDED_INDEX, PICKLE_FILE)):
        raise InvalidMedusaHeads(
            f"{path} has no weights: expected {MEDUSA_SAFETENSORS}, {MEDUSA_PICKLE}, {WEIGHTS_FILE} or {PICKLE_FILE}"
        )
    source = next(path / name for name in (WEIGHTS_FILE, SHARDED_INDEX, PICKLE_FILE) if (path / name).is_file())
    return read_weights(path, InvalidMedusaHeads), source


# ---------------------------------------------------------------------------------------------
# The two layouts


def _fasterdecoding(
    path: Path,
    config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    source: Path,
    hidden: int,
    vocab: int,
    target_name: str,
) -> PublishedMedusa:
    heads = _count(path, config, ("medusa_num_heads",), None)
    layers = _count(path, config, ("medusa_num_layers",), 1)
    trained_for = str(config.get("base_model_name_or_path") or "")

    def shapes(h: int, v: int) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for i in range(heads):
            for j in range(layers):
                out |= {f"{i}.{j}.linear.weight": (h, h), f"{i}.{j}.linear.bias": (h,)}
            out[f"{i}.{layers}.weight"] = (v, h)
        return out

    first, lm = state.get("0.0.linear.weight"), state.get(f"0.{layers}.weight")
    own = (int(lm.shape[1]), int(lm.shape[0])) if lm is not None and lm.dim() == 2 else None
    if own is None and first is not None and first.dim() == 2:
        own = (int(first.shape[1]), vocab)
    where = f"{source} ({FASTERDECODING} heads" + (f" for {trained_for})" if trained_for else ")")
    _check_tensors(state, shapes, hidden, vocab, own, where, target_name)
    for i in range(heads):
        copies = [(state[f"{i}.{j}.linear.weight"], state[f"{i}.{j}.linear.bias"]) for j in range(layers)]
        if any(not (torch.equal(copies[0][0], w) and torch.equal(copies[0][1], b)) for w, b in copies[1:]):
            logger.warning(
                "%s: the stored residual blocks of head %d differ; they are used as stored, where the reference "
                "(one block repeated per head) would use its last copy for every block",
                source,
                i,
            )
    blocks = {
        f"heads.{i}.{j}.linear.{part}": state[f"{i}.{j}.linear.{part}"]
        for i in range(heads)
        for j in range(layers)
        for part in ("weight", "bias")
    }
    weight = torch.stack([state[f"{i}.{layers}.weight"] for i in range(heads)])
    return PublishedMedusa(
        FASTERDECODING, heads, layers, blocks, OwnLMHeads(weight, vocab, FASTERDECODING), trained_for
    )


def _vllm(
    path: Path,
    config: Mapping[str, Any],
    raw: Mapping[str, torch.Tensor],
    source: Path,
    hidden: int,
    vocab: int,
    target_name: str,
) -> PublishedMedusa:
    heads = _count(path, config, ("num_heads", "medusa_num_heads"), VLLM_DEFAULTS["num_heads"])
    layers = _count(path, config, ("num_hidden_layers", "medusa_num_layers"), VLLM_DEFAULTS["num_hidden_layers"])
    own = (
        _count(path, config, ("hidden_size",), VLLM_DEFAULTS["hidden_size"]),
        _count(path, config, ("vocab_size",), VLLM_DEFAULTS["vocab_size"]),
    )
    where = f"{source} ({VLLM} heads)"
    if own != (hidden, vocab):
        raise _another_target(where, own, (hidden, vocab), target_name)
    truncated = config.get("truncated_vocab_size")
    truncated = vocab if truncated is None else _count(path, config, ("truncated_vocab_size",), None)
    if truncated > vocab:
        raise InvalidMedusaHeads(f"{path}: truncated_vocab_size {truncated} exceeds vocab_size {vocab}")
    bias, shared = _flag(path, config, "medusa_fc_bias"), _flag(path, config, "original_lm_head")
    scale = config.get("logit_scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale) or scale <= 0:
        raise InvalidMedusaHeads(
            f"{path}: logit_scale {scale!r} is not supported: only a positive finite scale keeps the heads' ranking "
            "(vLLM multiplies the logits by it); fix the config"
        )
    state = _strip(raw)
    trimmed = truncated < vocab
    lm_names = [f"lm_heads.{i}.weight" for i in range(heads)]
    if shared:
        given: list[str] = [name for name in ("lm_head.weight", "lm_heads.0.weight") if name in state]
        if len(given) > 1:
            raise InvalidMedusaHeads(f"{where} holds both lm_head.weight and lm_heads.0.weight: keep one")
        lm_names = given or ["lm_head.weight"]

    def shapes(h: int, v: int) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for i in range(heads):
            for j in range(layers):
                out[f"blocks.{i}.layers.{j}.weight"] = (h, h)
                if bias:
                    out[f"blocks.{i}.layers.{j}.bias"] = (h,)
        for name in lm_names:  # vLLM cuts a full-vocabulary LM head to the token map's rows
            stored = state.get(name)
            full = trimmed and stored is not None and stored.dim() == 2 and int(stored.shape[0]) == vocab
            out[name] = (vocab if full else truncated, h)
        if trimmed:
            out["token_map"] = (truncated,)
        elif "token_map" in state:  # unused at the full vocabulary, as in vLLM
            out["token_map"] = tuple(state["token_map"].shape)
        return out

    _check_tensors(state, shapes, hidden, vocab, None, where, target_name)
    token_map = _token_map(state["token_map"], vocab, where) if trimmed else None
    blocks: dict[str, torch.Tensor] = {}
    for i in range(heads):
        for j in range(layers):
            weight = state[f"blocks.{i}.layers.{j}.weight"]
            blocks[f"heads.{i}.{j}.linear.weight"] = weight
            blocks[f"heads.{i}.{j}.linear.bias"] = (
                state[f"blocks.{i}.layers.{j}.bias"] if bias else torch.zeros(hidden, dtype=weight.dtype)
            )
    lm = [state[name] for name in lm_names]
    if token_map is not None:
        lm = [w[token_map] if int(w.shape[0]) == vocab else w for w in lm]
    lm_heads = OwnLMHeads(torch.stack(lm), vocab, VLLM, token_map, float(scale))
    return PublishedMedusa(VLLM, heads, layers, blocks, lm_heads, "")


# ---------------------------------------------------------------------------------------------
# Checks


def _check_tensors(
    state: Mapping[str, torch.Tensor],
    shapes: Callable[[int, int], dict[str, tuple[int, ...]]],
    hidden: int,
    vocab: int,
    own: tuple[int, int] | None,
    where: str,
    target_name: str,
) -> None:
    """Every tensor of ``state`` by name and shape against ``shapes(hidden, vocab)``; when the names are right but
    the shapes all fit another target's ``own`` (hidden, vocab), that is the message."""
    expected = shapes(hidden, vocab)
    missing = sorted(name for name in expected if name not in state)
    unexpected = sorted(name for name in state if name not in expected)
    if missing or unexpected:
        problems = [f"missing {_listed(missing)}"] if missing else []
        problems += [f"unexpected {_listed(unexpected)}"] if unexpected else []
        raise InvalidMedusaHeads(
            f"{where} does not hold the tensors its config.json describes: {'; '.join(problems)}; "
            "use the heads as published, unchanged"
        )
    wrong = _wrong_shapes(state, expected)
    if wrong:
        if own is not None and own != (hidden, vocab) and not _wrong_shapes(state, shapes(*own)):
            raise _another_target(where, own, (hidden, vocab), target_name)
        raise InvalidMedusaHeads(f"{where} is malformed: {_listed(wrong)}; use the heads as published, unchanged")
    floats = [name for name, tensor in state.items() if name != "token_map" and not tensor.is_floating_point()]
    if floats:
        raise InvalidMedusaHeads(f"{where} is malformed: {_listed(floats)} should hold floating-point weights")


def _wrong_shapes(state: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    return [
        f"{name} has shape {list(state[name].shape)}, expected {list(shape)}"
        for name, shape in expected.items()
        if tuple(state[name].shape) != shape
    ]


def _another_target(where: str, own: tuple[int, int], target: tuple[int, int], target_name: str) -> InvalidMedusaHeads:
    return InvalidMedusaHeads(
        f"{where} were trained for a target with hidden size {own[0]} and {own[1]} tokens, but {target_name} has "
        f"hidden size {target[0]} and {target[1]} tokens; use heads trained for this target ({TRAIN_HINT})"
    )


def _token_map(token_map: torch.Tensor, vocab: int, where: str) -> torch.Tensor:
    """The token map as int64 ids; refused unless its ids are distinct target tokens."""
    if token_map.is_floating_point() or token_map.is_complex() or token_map.dtype == torch.bool:
        raise InvalidMedusaHeads(f"{where} is malformed: token_map is {token_map.dtype}, expected integer token ids")
    ids = token_map.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise InvalidMedusaHeads(f"{where} is malformed: token_map holds ids outside the target's 0 .. {vocab - 1}")
    if int(ids.unique().numel()) != int(ids.numel()):
        raise InvalidMedusaHeads(f"{where} is malformed: token_map repeats a token id (each draft row is one token)")
    return ids


def _count(path: Path, config: Mapping[str, Any], keys: Sequence[str], default: int | None) -> int:
    """The integer >= 1 under the first of ``keys`` present (all present ones must agree), else ``default``."""
    given = {key: config[key] for key in keys if key in config}
    if len(set(map(repr, given.values()))) > 1:
        raise InvalidMedusaHeads(f"{path}: config.json gives {given}, which disagree; keep one")
    if not given:
        if default is None:
            raise InvalidMedusaHeads(f"{path}: config.json lacks {keys[0]}; use the heads' config.json as published")
        return default
    key, value = next(iter(given.items()))
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidMedusaHeads(f"{path}: config.json's {key} is {value!r}, expected an integer >= 1")
    return value


def _flag(path: Path, config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        raise InvalidMedusaHeads(f"{path}: config.json's {key} is {value!r}, expected true or false")
    return value


def _strip(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stripped = {name.removeprefix(VLLM_PREFIX): tensor for name, tensor in state.items()}
    if len(stripped) != len(state):
        twice = sorted(name for name in stripped if name in state and VLLM_PREFIX + name in state)
        raise InvalidMedusaHeads(f"the heads hold {_listed(twice)} both with and without the {VLLM_PREFIX} prefix")
    return stripped


def _listed(items: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
