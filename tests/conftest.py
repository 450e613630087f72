"""Shared fixtures: random-initialised tiny causal LMs of two architectures, a char tokenizer, references.

Everything is built in-process, in float64, from fixed seeds, so every test is deterministic and
no hub or checkpoint directory is needed:

* ``llama`` — LlamaForCausalLM with grouped-query attention (4 query heads, 2 KV heads) and an
  untied ``lm_head``;
* ``qwen2`` — Qwen2ForCausalLM with tied input/output embeddings and q/k/v biases (randomised:
  Qwen2 initialises them to zero, which would make "has biases" vacuous).

Each target has a 1-layer draft sharing its vocabulary (and copying its embeddings, first block,
final norm and head, so the draft agrees with the target often but not always). The EOS row of the
output embedding is scaled up so that greedy decoding reaches EOS for some prompts; ``eos_prompts``
holds prompts whose greedy continuation ends with EOS a few tokens in.
"""

from __future__ import annotations

import json
import os
import shutil
import time

os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specserve.core.model.causal_lm import CausalLM

# The models here are tiny: intra-op threads only add synchronisation, and on a small shared
# machine (2 cores, often busy) they make each forward 20-200x slower through oversubscription.
torch.set_num_threads(1)

VOCAB = 96
PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
MAX_POSITIONS = 128
FAMILIES = ("llama", "qwen2")
SPECIALS = ("<pad>", "<s>", "</s>")
CHARS = tuple(chr(c) for c in range(32, 32 + VOCAB - len(SPECIALS)))  # " " .. "|"
REF_TOKENS = 40  # max_new_tokens of the reference continuations searched for EOS


# ---------------------------------------------------------------------------------------------
# Builders (plain functions, usable from tests that need a variant)


def char_tokenizer(reverse: bool = False) -> PreTrainedTokenizerFast:
    """A 96-token char-level tokenizer (3 specials + 93 printable ASCII chars), no merges.

    ``reverse=True`` gives a tokenizer of the same size with the chars assigned to other ids.
    """
    chars = list(reversed(CHARS)) if reverse else list(CHARS)
    vocab = {token: i for i, token in enumerate([*SPECIALS, *chars])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    assert len(tokenizer) == VOCAB
    return tokenizer


def randomise_(model: PreTrainedModel, seed: int, std: float = 0.2) -> None:
    """Re-draw every parameter (norm weights around 1, everything else incl. biases around 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=param.dtype)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            else:
                param.copy_(std * noise)


def build_model(family: str, num_layers: int = 2, seed: int = 0, vocab: int = VOCAB) -> PreTrainedModel:
    common = {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }
    if family == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=False))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    else:
        raise ValueError(family)
    model = model.double().eval()
    randomise_(model, seed)
    with torch.no_grad():
        model.get_output_embeddings().weight[EOS_ID] *= 2.0  # make EOS the argmax in some contexts
    return model


def build_draft(target: PreTrainedModel, family: str, seed: int = 1) -> PreTrainedModel:
    """A 1-layer model of the same family sharing the target's vocab, embeddings, first block, norm, head."""
    draft = build_model(family, num_layers=1, seed=seed, vocab=target.config.vocab_size)
    target_state = target.state_dict()
    state = {k: target_state[k].clone() if k in target_state else v for k, v in draft.state_dict().items()}
    draft.load_state_dict(state)
    return draft


def hf_greedy_ids(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, prompt stripped."""
    out = model.generate(
        torch.tensor([list(prompt)]),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    return out[0, len(prompt) :].tolist()


def finish_all(engine: Any, after_step: Callable[[], None] | None = None) -> dict[int, Any]:
    """Step a :class:`~specserve.core.batch_engine.BatchedEngine` until every submitted request has finished (calling
    ``after_step`` after each step); each one's :class:`~specserve.core.engine.GenerationResult` by request id."""
    results: dict[int, Any] = {}
    while engine.has_work:
        for request_id, chunk in engine.step():
            if isinstance(chunk, Exception):
                raise chunk
            if chunk.result is not None:
                results[request_id] = chunk.result
        if after_step is not None:
            after_step()
    return results


def assert_pool_empty(engine: Any) -> None:
    """No request holds KV in a :class:`~specserve.core.batch_engine.BatchedEngine`'s pool: every span left is a
    retained prefix-cache entry (none shared by a running request), the cache's count of them is right, and clearing
    the cache gives every position back."""
    pool, cache = engine.pool, engine.cache
    retained = cache.stats.retained_entries if cache is not None else 0
    assert pool.num_sequences == retained, f"{pool.num_sequences} spans held, {retained} of them retained entries"
    if cache is not None:
        assert len(cache.index) == retained  # no running request still shares its prefix
        held = pool.capacity - pool.free_tokens
        assert held == cache.stats.retained_tokens, f"{held} positions held, {cache.stats.retained_tokens} retained"
        cache.clear()
        assert cache.stats.retained_entries == 0 and cache.stats.retained_tokens == 0
    assert pool.num_sequences == 0 and pool.free_tokens == pool.capacity


def no_cache_greedy_ids(model: PreTrainedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding by full re-forwards without any cache, never stopping at EOS."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


# ---------------------------------------------------------------------------------------------
# Fixtures


@dataclass(frozen=True)
class TinyPair:
    family: str
    target: CausalLM
    draft: CausalLM  # 1-layer draft sharing the vocabulary
    prompts: tuple[tuple[int, ...], ...]  # mixed prompts, incl. repetitive ones and a 1-token prompt
    eos_prompts: tuple[tuple[int, ...], ...]  # greedy continuation ends with EOS after >= 3 tokens
    length_prompts: tuple[tuple[int, ...], ...]  # greedy continuation has no EOS in REF_TOKENS tokens


def _make_pair(family: str) -> TinyPair:
    target_model = build_model(family, num_layers=2, seed=0)
    draft_model = build_draft(target_model, family, seed=1)
    tokenizer = char_tokenizer()
    target = CausalLM(target_model, tokenizer, path=f"<{family}-target>")
    draft = CausalLM(draft_model, tokenizer, path=f"<{family}-draft>")

    generator = torch.Generator().manual_seed(123)
    eos_prompts: list[tuple[int, ...]] = []
    length_prompts: list[tuple[int, ...]] = []
    for _ in range(60):
        if len(eos_prompts) >= 3 and len(length_prompts) >= 3:
            break
        size = int(torch.randint(2, 9, (1,), generator=generator))
        prompt = tuple(torch.randint(3, VOCAB, (size,), generator=generator).tolist())
        ref = hf_greedy_ids(target_model, prompt, REF_TOKENS)
        if EOS_ID in ref and ref.index(EOS_ID) >= 3 and len(eos_prompts) < 3:
            eos_prompts.append(prompt)
        elif EOS_ID not in ref and len(length_prompts) < 3:
            length_prompts.append(prompt)
    assert eos_prompts, f"{family}: no prompt reaches EOS; adjust the EOS bias in build_model"
    assert length_prompts, f"{family}: every prompt reaches EOS"

    repetitive = (
        (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7),
        (40, 41, 40, 41, 40, 41, 40),
        (9, 9, 9, 9, 9, 9),
    )
    prompts = (*repetitive, (17,), *length_prompts[:2], *eos_prompts[:2])
    return TinyPair(family, target, draft, prompts, tuple(eos_prompts), tuple(length_prompts))


@pytest.fixture(scope="session")
def tiny_pairs() -> dict[str, TinyPair]:
    return {family: _make_pair(family) for family in FAMILIES}


@pytest.fixture(scope="session", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tiny_pairs: dict[str, TinyPair]) -> TinyPair:
    return tiny_pairs[request.param]


@pytest.fixture(scope="session")
def hf_greedy() -> Callable[[CausalLM, Sequence[int], int], list[int]]:
    """``hf_greedy(lm, prompt, max_new_tokens)``: transformers' greedy continuation, memoised per session."""
    # keyed by id(model); each entry keeps its model alive so a freed model's id is never reused for another
    memo: dict[tuple[int, tuple[int, ...], int], tuple[PreTrainedModel, list[int]]] = {}

    def run(lm: CausalLM, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        key = (id(lm.model), tuple(prompt), max_new_tokens)
        if key not in memo:
            memo[key] = (lm.model, hf_greedy_ids(lm.model, prompt, max_new_tokens))
        return list(memo[key][1])

    return run


@pytest.fixture(scope="session")
def saved_pair_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_pairs: dict[str, TinyPair]) -> dict[str, Path]:
    """The llama target and draft saved with ``save_pretrained`` (safetensors + tokenizer files)."""
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = {}
    llama = tiny_pairs["llama"]
    for role, lm in (("target", llama.target), ("draft", llama.draft)):
        directory = root / f"llama-{role}"
        lm.model.save_pretrained(directory)
        assert lm.tokenizer is not None
        lm.tokenizer.save_pretrained(directory)
        dirs[role] = directory
    return dirs


# ---------------------------------------------------------------------------------------------
# Ray: one local cluster for the whole session, and the tiny models saved where actors can load them


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray instance on 127.0.0.1 (every process of it listening on loopback, as a private Ray of
    :func:`~specserve.cluster.connect.connect_ray` does) declaring the "large" and "cheap" resources placement uses."""
    import ray

    from specserve.cluster.connect import loopback_only

    if not ray.is_initialized():
        with loopback_only():
            ray.init(
                num_cpus=16,  # logical: two replicas (one up to TP 4) must fit, whatever the real core count
                resources={"large": 8, "cheap": 2},
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                _system_config={"metrics_report_interval_ms": 1000},  # metrics reach the exporter within ~1 s
            )
    yield ray
    ray.shutdown()


def cases_in_use(request: pytest.FixtureRequest, fixture: str) -> list[str]:
    """The params of the module-scoped, parametrised ``fixture`` that this session's tests of the requesting module
    use, in the order they run (a module fixture may prepare them all at once)."""
    module = request.node.path
    names = [item.callspec.params.get(fixture) for item in request.session.items if item.path == module]  # type: ignore[attr-defined]
    return list(dict.fromkeys(name for name in names if name is not None))


class SharedReplicas:
    """Replicas of the distributed runtime that consecutive test modules use alike (``shared_replicas``): each is
    spawned when first asked for, with ``DRAFTER_MAX_RESTARTS`` raised (their users' fault tests each cost the drafter
    a restart or two), and all are shut down after the last test of the session that uses the fixture (the
    ``pytest_runtest_teardown`` hook below), so that later modules find the cluster's resources free.

    Every user gets a :class:`~specserve.actors.coordinator.Coordinator` of its own (a fresh front door: none of
    another module's fault bookkeeping), whose view of the settings only the coordinator reads (``stall_timeout_s``)
    may differ; and only once the replica's shards and drafter answer (a previous user may have left the drafter
    restarting). A replica whose shards do not answer (a previous user broke it) is replaced.
    """

    DRAFTER_MAX_RESTARTS = 10
    COORDINATOR_ONLY = frozenset({"stall_timeout_s"})  # settings the actors never read

    def __init__(self) -> None:
        self.replicas: dict[str, Any] = {}

    def coordinator(self, config: Any, **coordinator_settings: Any) -> Any:
        import dataclasses

        import ray

        from specserve.actors import replica as replica_module
        from specserve.actors.coordinator import Coordinator

        assert set(coordinator_settings) <= self.COORDINATOR_ONLY, coordinator_settings
        key = config.model_dump_json()
        replica = self.replicas.get(key)
        if replica is not None:
            try:
                ray.get([shard.node_id.remote() for shard in replica.shards], timeout=30)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                del self.replicas[key]
                replica.shutdown()
                replica = None
        if replica is None:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(replica_module, "DRAFTER_MAX_RESTARTS", self.DRAFTER_MAX_RESTARTS)
                replica = self.replicas[key] = replica_module.spawn_replica(config)
        deadline = time.monotonic() + 120
        while True:  # Ray restarts a drafter a previous user killed: wait until it answers
            try:
                ray.get(replica.drafter.node_id.remote(), timeout=5)
                break
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                assert time.monotonic() < deadline, "the shared replica's drafter did not come back"
                time.sleep(0.5)
        if coordinator_settings:
            replica = dataclasses.replace(replica, config=config.model_copy(update=coordinator_settings))
        return Coordinator(replica)

    def prepare(self, configs: Iterable[Any]) -> None:
        """Spawns those of ``configs`` not spawned yet all at once, on threads: a replica's start keeps about one core
        busy at a time (its shard, then its drafter, each a process importing torch and loading weights)."""
        from concurrent.futures import ThreadPoolExecutor

        from specserve.actors import replica as replica_module

        missing = {config.model_dump_json(): config for config in configs}
        missing = {key: config for key, config in missing.items() if key not in self.replicas}
        if len(missing) < 2:
            return  # spawned when asked for
        with pytest.MonkeyPatch.context() as patch, ThreadPoolExecutor(len(missing)) as pool:
            patch.setattr(replica_module, "DRAFTER_MAX_RESTARTS", self.DRAFTER_MAX_RESTARTS)
            futures = {key: pool.submit(replica_module.spawn_replica, config) for key, config in missing.items()}
            errors = [future.exception() for future in futures.values()]
        for key, future in futures.items():
            if future.exception() is None:
                self.replicas[key] = future.result()
        for error in errors:
            if error is not None:
                raise error

    def close(self) -> None:
        while self.replicas:
            self.replicas.popitem()[1].shutdown()


_shared_replicas: SharedReplicas | None = None
_last_shared_user: pytest.Item | None = None


@pytest.fixture(scope="session")
def shared_replicas(ray_cluster: Any, request: pytest.FixtureRequest) -> Iterator[SharedReplicas]:
    global _shared_replicas, _last_shared_user
    users = [item for item in request.session.items if "shared_replicas" in item.fixturenames]
    _last_shared_user = users[-1] if users else None
    _shared_replicas = SharedReplicas()
    try:
        yield _shared_replicas
    finally:
        _shared_replicas.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test that uses ``shared_replicas``, its replicas are shut down (the fixture itself, being
    session-scoped, would hold them, and the cluster's resources, until the session ends)."""
    try:
        return (yield)
    finally:
        if _shared_replicas is not None and item is _last_shared_user:
            _shared_replicas.close()


# A test needs Ray (marker ``ray``) when its fixtures, transitively, include one of RAY_FIXTURES, or when it is marked
# by hand (a CLI run that starts a Ray of its own): ``-m "not ray"`` runs the in-process tests alone.
RAY_FIXTURES = frozenset({"ray_cluster", "serve_url", "shared_replicas"})


# The quick loop (``make test-quick``, marker ``quick``): the exactness core, in process. Each entry is a path under
# tests/ and, where only some of its tests belong, a word their names hold: the acceptance rules (chains, trees, the
# wire codec), the engine and the batched engine against transformers' ``generate``, and every drafter's greedy
# equality on the tiny models; the import order.
QUICK_LOOP: dict[str, str | None] = {
    "core/verify/test_verification.py": None,
    "core/verify/test_tree_verification.py": None,
    "core/test_engine.py": None,
    "core/test_batch_engine.py": None,
    "core/kv/test_prefix_cache.py": None,
    "rpc/test_codec.py": None,
    "drafters/": "greedy",
    "test_layering.py": None,
}
TESTS = Path(__file__).resolve().parent


def in_quick_loop(item: pytest.Item) -> bool:
    where = item.path.relative_to(TESTS).as_posix()
    return any(
        (where == path or (path.endswith("/") and where.startswith(path))) and (word is None or word in item.name)
        for path, word in QUICK_LOOP.items()
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if in_quick_loop(item):
            item.add_marker(pytest.mark.quick)
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def serve_url(ray_cluster: Any) -> Iterator[str]:
    """Ray Serve's HTTP proxy on 127.0.0.1 (a free port) in the session's Ray; test modules run their own apps."""
    import socket

    from ray import serve

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


@pytest.fixture(scope="session")
def saved_pairs(tmp_path_factory: pytest.TempPathFactory, tiny_pairs: dict[str, TinyPair]) -> dict[str, Path]:
    """Each family's tiny target and draft saved (with the char tokenizer) as checkpoint directories."""
    root = tmp_path_factory.mktemp("tiny-models")
    out = {}
    for family, tiny in tiny_pairs.items():
        for role, lm in (("target", tiny.target), ("draft", tiny.draft)):
            directory = root / family / role
            lm.model.save_pretrained(directory)
            assert lm.tokenizer is not None
            lm.tokenizer.save_pretrained(directory)
        out[family] = root / family
    return out


LONG_CONTEXT = 2048  # positions the long-context pair's configs declare


@pytest.fixture(scope="session")
def long_context_pair(saved_pairs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama target and draft, their configs saying LONG_CONTEXT positions (rotary: any length works), so
    that a served request can outlive a test's other calls."""
    root = tmp_path_factory.mktemp("long-context")
    for role in ("target", "draft"):
        shutil.copytree(saved_pairs["llama"] / role, root / role)
        path = root / role / "config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "max_position_embeddings": LONG_CONTEXT}))
    return root
