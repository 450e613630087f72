"""Tests of the Hugging Face adapter: KV cache rollback, block forwards, loading checkpoint directories."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import EOS_ID, MAX_POSITIONS, VOCAB, TinyPair

from specserve.core.kv.cache import KVCache
from specserve.core.model.causal_lm import CausalLM, resolve_device, resolve_dtype
from specserve.core.model.checkpoint_dir import ModelLoadError

TOKENS = [5, 17, 33, 2, 60, 61, 62, 9, 9, 41, 77, 3, 88, 14]


def prefill(lm: CausalLM, ids: list[int]) -> tuple[KVCache, torch.Tensor]:
    cache = lm.new_cache()
    logits = lm.forward(cache, torch.tensor(ids, dtype=torch.long)) if ids else torch.empty(0)
    return cache, logits


def assert_same_kv(got: KVCache, want: KVCache, atol: float = 1e-12) -> None:
    assert got.length == want.length
    layers = got.inner.layers
    assert len(layers) == len(want.inner.layers) > 0
    for i, (a, b) in enumerate(zip(layers, want.inner.layers, strict=True)):
        assert a.keys.shape == b.keys.shape, f"layer {i}: key shapes {a.keys.shape} vs {b.keys.shape}"
        assert a.values.shape == b.values.shape
        assert torch.allclose(a.keys, b.keys, rtol=0, atol=atol), f"layer {i} keys differ"
        assert torch.allclose(a.values, b.values, rtol=0, atol=atol), f"layer {i} values differ"


# ---------------------------------------------------------------------------------------------
# Forward and rollback


def test_info_and_dtype(pair: TinyPair) -> None:
    info = pair.target.info
    assert info.vocab_size == VOCAB
    assert info.max_positions == MAX_POSITIONS
    assert info.eos_token_ids == (EOS_ID,)
    assert info.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[pair.family]
    assert pair.target.dtype == torch.float64
    assert pair.target.device == torch.device("cpu")
    config = pair.target.model.config
    if pair.family == "llama":
        assert config.num_key_value_heads < config.num_attention_heads  # GQA
        assert pair.target.model.lm_head.weight is not pair.target.model.model.embed_tokens.weight
    else:
        assert pair.target.model.lm_head.weight is pair.target.model.model.embed_tokens.weight  # tied
        assert pair.target.model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0  # real biases


def test_block_forward_matches_one_full_forward(pair: TinyPair) -> None:
    lm = pair.target
    full = lm.model(input_ids=torch.tensor([TOKENS])).logits[0].detach()
    cache = lm.new_cache()
    pieces = [TOKENS[:5], TOKENS[5:6], TOKENS[6:10], TOKENS[10:]]
    rows = [lm.forward(cache, torch.tensor(piece)) for piece in pieces]
    assert cache.length == len(TOKENS)
    assert torch.allclose(torch.cat(rows), full, rtol=0, atol=1e-10)
    last = lm.forward(lm.new_cache(), torch.tensor(TOKENS), last_only=True)
    assert last.shape == (1, VOCAB)
    assert torch.allclose(last[0], full[-1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("keep", [1, 4, 9, 13])
def test_rollback_equals_fresh_prefill(pair: TinyPair, keep: int) -> None:
    lm = pair.target
    cache = lm.new_cache()
    lm.forward(cache, torch.tensor(TOKENS[:6]))
    lm.forward(cache, torch.tensor(TOKENS[6:]))  # prompt, then a "draft" block
    assert cache.length == len(TOKENS)
    cache.rollback(keep)
    assert cache.length == keep
    fresh, _ = prefill(lm, TOKENS[:keep])
    assert_same_kv(cache, fresh)

    # the next forward after the rollback is positioned like a fresh forward over prefix + tokens
    for block in ([70], [70, 71, 72]):
        c1, _ = prefill(lm, TOKENS)
        c1.rollback(keep)
        after_rollback = lm.forward(c1, torch.tensor(block))
        reference = lm.model(input_ids=torch.tensor([TOKENS[:keep] + block])).logits[0, keep:].detach()
        assert torch.allclose(after_rollback, reference, rtol=0, atol=1e-10)
        assert c1.length == keep + len(block)


def test_rollback_to_zero_and_to_current_length(pair: TinyPair) -> None:
    lm = pair.target
    cache, _ = prefill(lm, TOKENS)
    cache.rollback(len(TOKENS))  # no-op
    assert_same_kv(cache, prefill(lm, TOKENS)[0])
    cache.rollback(0)
    assert cache.length == 0
    logits = lm.forward(cache, torch.tensor(TOKENS[:3]))
    fresh_cache, fresh_logits = prefill(lm, TOKENS[:3])
    assert torch.allclose(logits, fresh_logits, rtol=0, atol=1e-12)
    assert_same_kv(cache, fresh_cache)


def test_repeated_rollbacks_and_regrowth(pair: TinyPair) -> None:
    """The engine's pattern: verify a block, keep part of it, verify the next block, ..."""
    lm = pair.target
    cache, _ = prefill(lm, TOKENS[:4])
    committed = TOKENS[:4]
    for block, keep in (([11, 12, 13, 14], 2), ([21, 22], 0), ([31, 32, 33], 3), ([41], 1)):
        lm.forward(cache, torch.tensor(block))
        cache.rollback(len(committed) + keep)
        committed = committed + block[:keep]
        assert_same_kv(cache, prefill(lm, committed)[0], atol=1e-10)


def test_rollback_out_of_range(pair: TinyPair) -> None:
    cache, _ = prefill(pair.target, TOKENS[:5])
    with pytest.raises(ValueError, match="cannot roll back a cache of length 5 to 6"):
        cache.rollback(6)
    with pytest.raises(ValueError, match="cannot roll back a cache of length 5 to -1"):
        cache.rollback(-1)
    assert cache.length == 5


# ---------------------------------------------------------------------------------------------
# Loading


def test_load_roundtrip(saved_pair_dirs: dict[str, Path], tiny_pairs: dict[str, TinyPair]) -> None:
    directory = saved_pair_dirs["target"]
    original = tiny_pairs["llama"].target
    loaded = CausalLM.load(directory, dtype="float64")
    assert loaded.dtype == torch.float64
    assert loaded.info.path == str(directory)
    assert loaded.info.vocab_size == VOCAB
    assert loaded.info.eos_token_ids == (EOS_ID,)
    assert loaded.info.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer is not None and original.tokenizer is not None
    assert loaded.tokenizer.get_vocab() == original.tokenizer.get_vocab()
    ids = loaded.tokenizer("round trip!", add_special_tokens=False)["input_ids"]
    assert ids == original.tokenizer("round trip!", add_special_tokens=False)["input_ids"]
    assert loaded.tokenizer.decode(ids) == "round trip!"
    got = loaded.forward(loaded.new_cache(), torch.tensor(TOKENS))
    want = original.forward(original.new_cache(), torch.tensor(TOKENS))
    assert torch.equal(got, want)

    as_float32 = CausalLM.load(str(directory))  # default dtype, str path
    assert as_float32.dtype == torch.float32


def test_load_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        CausalLM.load(tmp_path / "nope")


def test_load_file_instead_of_directory(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"not a directory")
    with pytest.raises(ModelLoadError, match="is not a directory"):
        CausalLM.load(file)


def test_load_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        CausalLM.load(tmp_path)


def test_load_malformed_config(tmp_path: Path, saved_pair_dirs: dict[str, Path]) -> None:
    bad = tmp_path / "bad-json"
    shutil.copytree(saved_pair_dirs["target"], bad)
    (bad / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(ModelLoadError, match=r"config.json is not valid JSON"):
        CausalLM.load(bad)

    unknown = tmp_path / "unknown-type"
    shutil.copytree(saved_pair_dirs["target"], unknown)
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "no-such-architecture"
    (unknown / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="could not load a causal LM from"):
        CausalLM.load(unknown)


def test_load_directory_without_weights(tmp_path: Path, saved_pair_dirs: dict[str, Path]) -> None:
    shutil.copy(saved_pair_dirs["target"] / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match=r"has no weights \(\*\.safetensors or \*\.bin\)"):
        CausalLM.load(tmp_path)


@pytest.mark.parametrize("damage", ["garbage-safetensors", "truncated-safetensors", "garbage-bin"])
def test_load_corrupt_weights(tmp_path: Path, saved_pair_dirs: dict[str, Path], damage: str) -> None:
    directory = tmp_path / "damaged"
    shutil.copytree(saved_pair_dirs["target"], directory)
    weights = directory / "model.safetensors"
    if damage == "garbage-safetensors":
        weights.write_bytes(b"\x00garbage")
    elif damage == "truncated-safetensors":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        weights.unlink()
        (directory / "pytorch_model.bin").write_bytes(b"\x00garbage")
    with pytest.raises(ModelLoadError, match="could not load a causal LM from"):
        CausalLM.load(directory)


def test_bad_dtype_and_device(saved_pair_dirs: dict[str, Path]) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'float13'; choose one of"):
        CausalLM.load(saved_pair_dirs["target"], dtype="float13")
    with pytest.raises(ModelLoadError, match="unknown device 'tpu'"):
        CausalLM.load(saved_pair_dirs["target"], device="tpu")
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device is available"):
            resolve_device("cuda")
