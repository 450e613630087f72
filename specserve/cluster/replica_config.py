"""The one replica configuration: every setting of a target replica, typed, bounded, documented and checked.

:class:`ReplicaConfig` is the source of truth for what a replica is — its models, dtype, device,
tensor-parallel degree, drafter placement, threads, timeouts and the resources it asks Ray for.
The other edges derive from it instead of declaring the settings again:

* Python: ``ReplicaConfig(target=..., tp_degree=2)``; a value of the wrong type or out of range
  raises pydantic's ``ValidationError`` naming the field, and settings that disagree (n-gram
  sizes, a TP degree that is no power of two, resource names) a
  :class:`~specserve.core.errors.UserError` saying what to change (both are ``ValueError``);
* the Serve config YAML: :class:`~specserve.serve.config.ServeConfig` inherits these fields, so
  its ``args`` carry them under the same names, one to one;
* the command line: :meth:`ReplicaConfig.add_arguments` makes one flag per field (name, type,
  default, help, choices from the field) and :meth:`ReplicaConfig.from_args` reads them back;
* placement: :meth:`ReplicaConfig.spec` derives the :class:`~specserve.cluster.placement.ClusterSpec`
  from the fields the two share by name.

Model paths are made absolute here, once (:func:`resolve_model_path`): a plain model directory
and the directory in ``eagle:DIR``, ``medusa:DIR``, ``pard:DIR`` and ``layerskip:DIR``, when it exists where
the configuration is read, so that a replica started on another node or in another working
directory finds it.

Does not start, place or load anything (:mod:`specserve.actors.replica` does).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Literal, Self, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from specserve import defaults
from specserve.cluster.placement import MAX_TP, Accelerator, ClusterSpec, DrafterPlacement
from specserve.core.draft.spec_strings import absolute_spec, check_drafter_spec
from specserve.core.errors import UserError
from specserve.core.model.buckets import VerifyBuckets
from specserve.core.model.checkpoint_dir import check_checkpoint_dir
from specserve.core.static.options import StaticOptions

Dtype = Literal["float32", "float64", "bfloat16", "float16"]
Device = Literal["cpu", "cuda"]  # one GPU per process: Ray gives each actor its own (CUDA_VISIBLE_DEVICES)
_SPEC = ClusterSpec()  # the placement defaults (resource names, CPUs per actor)

# Where the command line and the Serve YAML differ from Python: left out there, they mean the shipped pair.
EDGE_DEFAULTS: dict[str, str] = {"target": str(defaults.DEFAULT_TARGET), "draft": str(defaults.DEFAULT_DRAFT)}


class InvalidSetting(UserError):
    """A setting has a wrong type or is out of range, or settings disagree; the message names them."""


def resolve_model_path(spec: str) -> str:
    """``spec`` (a target directory or any drafter spec) with the directory it names made absolute when that
    directory exists here; anything else unchanged (:func:`specserve.core.draft.spec_strings.absolute_spec`)."""
    return absolute_spec(spec)


class ReplicaConfig(BaseModel):
    """Every setting of one target replica (its tensor-parallel shards and its drafter)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Command-line flags whose names predate this class; every other field's flag is its name in kebab case.
    FLAGS: ClassVar[dict[str, str]] = {"tp_degree": "--tp", "max_ngram": "--ngram-max", "min_ngram": "--ngram-min"}

    # ---- the models
    target: str = Field(
        description="target model directory (a local HF checkpoint); a relative path is made absolute where the "
        "configuration is read, and must exist on every node that hosts a shard or a drafter",
    )
    draft: str = Field(
        "ngram",
        description="who drafts: a draft model directory, 'ngram' (prompt lookup), 'suffix' (suffix decoding), "
        "'layerskip:L' (the target's first L layers) or 'layerskip:DIR' (with a trained exit head), 'eagle:DIR' or "
        "'medusa:DIR' (trained heads), 'pard:DIR' (a PARD draft model: a block per forward), 'mtp' (the MTP layer "
        "in the target's checkpoint), 'rest:FILE' (retrieval "
        "from a token datastore: specserve datastore build), "
        "or 'none'; directories and datastore files are made absolute as the target's",
    )
    dtype: Dtype = Field("float32", description="weights dtype of the target and the drafter")
    device: Device = Field("cpu", description="where the models compute; cuda: one GPU per shard and drafter")
    static_shapes: Literal["auto", "on", "off"] = Field(
        "auto",
        description="the static-shape engine (in process): a preallocated KV cache, verify blocks padded to "
        "--buckets, and on a GPU every bucket's forward replayed as a CUDA graph; auto = on with --device cuda only",
    )
    buckets: str = Field(
        "",
        description="the widths verify blocks pad to with static shapes, e.g. 1,2,4,8,16 (empty: the device's "
        "default, chosen from measured verify times; none: no padding)",
    )
    row_buckets: str = Field(
        "",
        description="with static shapes and CUDA graphs, the batch sizes a batched step pads to and replays a graph "
        "of, e.g. 1,2,4,8,16,32 (empty: powers of two to 256; none: batched steps run eagerly); the device check "
        "measures T(rows, width) and prints the ones it would choose",
    )
    no_cuda_graphs: bool = Field(False, description="with static shapes on a GPU, run every forward eagerly")
    compile: bool = Field(False, description="with static shapes, torch.compile the target's forward as well")
    max_ngram: int = Field(3, ge=1, description="longest n-gram the ngram drafter matches")
    min_ngram: int = Field(1, ge=1, description="shortest n-gram the ngram drafter matches (<= max_ngram)")
    suffix_store: Literal["replica", "cluster"] = Field(
        "replica",
        description="the suffix drafter's store of finished outputs: this replica's own (replica), or also every "
        "other replica's in the Ray namespace (cluster: one shared Ray actor; a replica sees another's output about "
        "a second after it finished)",
    )

    # ---- the distributed runtime
    tp_degree: int = Field(
        1, description=f"tensor-parallel degree of the target replica: shards, a power of two from 1 to {MAX_TP}"
    )
    drafter_placement: DrafterPlacement = Field(
        "colocated",
        description="drafter in the target's placement group (colocated), on a node with the 'cheap' resource "
        "(separate), or a member of a drafter pool on cheap nodes shared with other replicas of the model (pool)",
    )
    pool_ratio: int = Field(
        2,
        ge=1,
        description="with drafter_placement pool: replicas' full batches one pool member drafts for (it runs "
        "pool_ratio x max_num_seqs request loops; the pool holds one member per that many requests drafting)",
    )
    pool_min_members: int = Field(1, ge=1, description="with drafter_placement pool: members the pool keeps running")
    pool_max_members: int = Field(8, ge=1, description="with drafter_placement pool: members the pool grows to at most")
    pool_upscale_delay_s: float = Field(
        2.0, ge=0, description="with drafter_placement pool: seconds its load must want more members before it adds"
    )
    pool_downscale_delay_s: float = Field(
        30.0, ge=0, description="with drafter_placement pool: seconds its load must want fewer members before it stops"
    )
    overlap: bool = Field(
        False, description="draft the next chain while the target verifies (trees are drafted after each verdict)"
    )
    threads_per_shard: int = Field(
        1, ge=1, description="torch threads in each target shard actor (an in-process batched replica: its own)"
    )
    threads_per_drafter: int = Field(1, ge=1, description="torch threads in the drafter actor")
    verifier_host: str = Field(
        "127.0.0.1",
        description="interface rank 0's gRPC verifier binds: loopback when drafters share the node; '0.0.0.0' "
        "(advertised as the node's IP) when drafters run on other nodes (drafter_placement separate on a cluster)",
    )
    collective_timeout_s: float = Field(
        120.0,
        gt=0,
        description="seconds before a tensor-parallel collective fails (a dead rank becomes an error, not a hang); "
        "an idle replica's rank 0 sends heartbeats well within it",
    )
    ready_timeout_s: float = Field(
        120.0,
        gt=0,
        description="seconds to wait for the cluster to place the replica before failing with what it lacks",
    )
    stall_timeout_s: float = Field(
        10.0,
        gt=0,
        description="seconds a request waits for its drafter's next cycle (or for rank 0's prefill) before "
        "probing the replica: a frozen drafter is restarted and the request goes on without speculation; a "
        "target shard that is dead or does not answer fails the request (ReplicaLost)",
    )

    # ---- batching and the queue (`specserve generate` runs one request and ignores these)
    max_num_seqs: int = Field(
        1,
        ge=1,
        description="requests one replica generates at once. 1 (the default) = one at a time, the baseline every "
        "setting supports. > 1 = batched, one target forward per step for all its running requests: a Serve replica "
        "runs the in-process batched engine in its own process when it needs nothing only the distributed runtime "
        "does (tp_degree 1, no overlap, drafter colocated, gpus_per_drafter 0), the distributed runtime otherwise",
    )
    max_batch_tokens: int = Field(
        256,
        ge=1,
        description="batched replicas: prompt positions prefilled per step over all newcomers, in process (rows x "
        "widest chunk: the forward pads its rows), or per chunk between steps on the distributed runtime (chunked "
        "prefill: a long prompt delays the running requests by at most one such chunk per step)",
    )
    max_seq_len: int = Field(
        0,
        ge=0,
        description="batched replicas: tokens (prompt + max_tokens) one request may hold; 0 = the target's context; "
        "longer requests are refused",
    )
    kv_pool_tokens: int = Field(
        0,
        ge=0,
        description="batched replicas: token positions of the KV pool preallocated (on every shard, for its share of "
        "the heads). A request reserves its prompt + max_tokens + the widest draft block when it starts and waits "
        "while the pool lacks them; one that could never fit is refused. 0 = room for max_num_seqs requests of "
        "max_seq_len, within kv_cache_memory",
    )
    kv_cache_memory: float = Field(
        0.5,  # specserve.core.kv.pool.DEFAULT_MEMORY_FRACTION (a test checks they agree)
        gt=0,
        le=1,
        description="batched replicas with kv_pool_tokens 0: the KV pool takes at most this share of the memory free "
        "on each shard's device once the weights are loaded (the host's available memory on the CPU), and holds "
        "fewer than max_num_seqs requests of max_seq_len where that share is smaller; one that cannot hold a single "
        "such request is refused at start",
    )
    no_prefix_cache: bool = Field(
        False,
        description="batched replicas: prefill every prompt from its first token; by default a request copies the "
        "keys and values of the longest prefix of its prompt that an earlier or running request with the same API "
        "key and cache_salt cached (prompt and answer), kept in the KV pool and evicted least recently used",
    )
    batch_wait_ms: float = Field(
        20.0,
        ge=0,
        le=10_000,
        description="batched replicas on the distributed runtime: how long rank 0 waits, after a step's first draft "
        "arrives, for every running request's draft before verifying those it has (a slow drafter never holds the "
        "others up for longer)",
    )
    max_queue: int = Field(
        16,
        ge=0,
        description="requests a Serve replica lets wait beyond those it generates; one more is refused at once "
        "with 429 and Retry-After. Serve sends a replica at most max_ongoing_requests, so the bound bites only when "
        "that is above max_num_seqs + max_queue; the default, above Serve's default 8, refuses nothing by itself",
    )

    # ---- what the replica asks Ray for (the placement spec's fields, same names)
    large_resource: str = Field(_SPEC.large_resource, description="custom resource of nodes that host target shards")
    cheap_resource: str = Field(
        _SPEC.cheap_resource, description="custom resource of nodes that host separate drafters"
    )
    cpus_per_shard: float = Field(
        _SPEC.cpus_per_shard,
        description="Ray CPUs each shard actor reserves (> 0); an in-process batched replica, its own one shard, "
        "reserves them with one unit of large_resource",
    )
    cpus_per_drafter: float = Field(_SPEC.cpus_per_drafter, description="Ray CPUs the drafter actor reserves (> 0)")
    gpus_per_drafter: float = Field(
        _SPEC.gpus_per_drafter,
        description="GPUs the drafter actor reserves (device cuda only; a fraction shares one); 0 = the drafter actor "
        "runs on the CPU",
    )

    def __init__(self, /, **data: Any) -> None:
        """Validate. A check of ours (the placement spec's, the n-gram sizes) raises its own :class:`UserError`;
        a wrong type or an out-of-range field raises pydantic's ``ValidationError`` (a ``ValueError`` too)."""
        try:
            super().__init__(**data)
        except ValidationError as exc:
            errors = exc.errors()
            ours = errors[0].get("ctx", {}).get("error") if len(errors) == 1 else None
            if isinstance(ours, UserError):
                raise ours from None
            raise

    @field_validator("target", "draft")
    @classmethod
    def _absolute_paths(cls, value: str) -> str:
        return resolve_model_path(value)

    @field_validator("tp_degree")
    @classmethod
    def _power_of_two(cls, value: int) -> int:
        if not 1 <= value <= MAX_TP or value & (value - 1):
            raise ValueError(f"must be a power of two from 1 to {MAX_TP} (the target's heads split evenly)")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.min_ngram > self.max_ngram:
            raise InvalidSetting(
                f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {self.min_ngram}..{self.max_ngram}"
            )
        if self.kv_pool_tokens and self.max_seq_len and self.kv_pool_tokens < self.max_seq_len:
            raise InvalidSetting(
                f"kv_pool_tokens {self.kv_pool_tokens} cannot hold one request of max_seq_len {self.max_seq_len}; "
                "raise kv_pool_tokens (0 = room for max_num_seqs such requests) or lower max_seq_len"
            )
        if self.pool_min_members > self.pool_max_members:
            raise InvalidSetting(
                f"a drafter pool needs pool_min_members <= pool_max_members, got {self.pool_min_members} > "
                f"{self.pool_max_members}"
            )
        self.spec()  # tp_degree a power of two, resource names, CPUs: the placement spec checks them
        return self

    def check_local_models(self) -> None:
        """Raise a :class:`UserError` unless the target and the drafter this configuration names exist here (with
        the download recipe for a hub id, the valid drafters and the closest for a typo). For commands that load
        the models on this machine, before anything starts; a configuration read for a cluster whose nodes hold
        the models elsewhere is not checked."""
        check_checkpoint_dir(self.target, "target model directory")
        check_drafter_spec(self.draft)

    @property
    def batched(self) -> bool:
        """Whether a replica of this configuration generates several requests at once (``max_num_seqs > 1``)."""
        return self.max_num_seqs > 1

    @property
    def batches_in_process(self) -> bool:
        """Whether a batched Serve replica runs the in-process batched engine: it needs nothing only the distributed
        runtime does (tensor-parallel shards, overlap, a separate, pooled or GPU-reserving drafter actor)."""
        distributed_only = self.tp_degree > 1 or self.overlap or self.drafter_placement in ("separate", "pool")
        return self.batched and not distributed_only and self.gpus_per_drafter == 0

    def spec(self) -> ClusterSpec:
        """The placement spec of this one replica: the fields the two share by name, the accelerator from ``device``."""
        names = type(self).model_fields
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(ClusterSpec) if f.name in names}
        accelerator: Accelerator = "gpu" if self.device.startswith("cuda") else "cpu"
        return ClusterSpec(target_replicas=1, accelerator=accelerator, **shared)

    def drafter_options(self) -> dict[str, Any]:
        """What building the drafter takes besides its spec and the target, under the names
        :func:`~specserve.drafters.registry.build_drafter` and the drafter actor use."""
        return {"dtype": self.dtype, "device": self.device, "max_ngram": self.max_ngram, "min_ngram": self.min_ngram}

    @property
    def drafter_actor_device(self) -> str:
        """Where a distributed replica's drafter actor computes: the replica's device when it reserves GPUs
        (``gpus_per_drafter > 0``); otherwise the CPU, since Ray shows an actor without GPUs none."""
        return self.device if self.gpus_per_drafter > 0 else "cpu"

    # ---- the command line

    @field_validator("buckets", "row_buckets")
    @classmethod
    def _buckets(cls, value: str) -> str:
        if value:
            VerifyBuckets.parse(value)  # raises a UserError saying what to write
        return value

    def static_options(self) -> StaticOptions | None:
        """The static-shape engine's options, or ``None`` when this replica runs growing caches (``static_shapes``
        off, or auto on a CPU)."""
        if self.static_shapes == "off" or (self.static_shapes == "auto" and self.device != "cuda"):
            return None
        buckets = VerifyBuckets.parse(self.buckets) if self.buckets else None
        rows = VerifyBuckets.parse(self.row_buckets) if self.row_buckets else None
        return StaticOptions(buckets, cuda_graphs=not self.no_cuda_graphs, compile=self.compile, row_buckets=rows)

    @classmethod
    def flag(cls, name: str) -> str:
        """The command-line flag of field ``name``."""
        return cls.FLAGS.get(name, "--" + name.replace("_", "-"))

    @classmethod
    def add_arguments(cls, parser: argparse._ActionsContainer, names: Iterable[str], over: str | None = None) -> None:
        """One flag per named field, with the field's type, default, description and choices; a setting left
        out means what it means in the Serve YAML (:data:`EDGE_DEFAULTS`: the shipped pair).

        With ``over`` (what a left-out flag defers to, e.g. ``"the --config file's"``) the flags override a base
        configuration instead: one left out is absent from the parsed namespace (``argparse.SUPPRESS``), so
        :meth:`from_args` keeps the base's value; its help says so and names the field's default; a switch then
        comes with its ``--no-`` form."""
        for name in names:
            field = cls.model_fields[name]
            default = EDGE_DEFAULTS.get(name, field.default)
            options: dict[str, Any] = {"dest": name, "help": (field.description or "").replace("%", "%%")}
            if over is not None:
                options["default"] = argparse.SUPPRESS
                options["help"] += _override_help(over, default)
            elif default is PydanticUndefined:
                options["required"] = True
            else:
                options["default"] = default
            options.update(_argument_type(name, field, switch_off=over is not None))
            if "action" not in options and "choices" not in options:
                options["metavar"] = cls.flag(name).removeprefix("--").replace("-", "_").upper()
            parser.add_argument(cls.flag(name), **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, base: Mapping[str, Any] | None = None) -> Self:
        """The configuration the parsed flags describe, over ``base`` (settings: what a field without a flag
        keeps; default: the fields' defaults); a bad value raises a :class:`UserError` naming its flag."""
        given = {name: getattr(args, name) for name in cls.model_fields if hasattr(args, name)}
        try:
            return cls(**{**(base or {}), **given})
        except ValidationError as exc:
            reasons = [
                f"{_where(cls, e['loc'])}: {validator_words(e['msg'])}, got {e['input']!r}" for e in exc.errors()
            ]
            raise InvalidSetting("; ".join(reasons)) from None


# The settings an in-process run uses too (the rest only matter to a distributed replica).
MODEL_SETTINGS = (
    "target",
    "draft",
    "dtype",
    "device",
    "static_shapes",
    "buckets",
    "row_buckets",
    "no_cuda_graphs",
    "compile",
    "max_ngram",
    "min_ngram",
)
DISTRIBUTED_SETTINGS = tuple(name for name in ReplicaConfig.model_fields if name not in MODEL_SETTINGS)


def with_edge_default(name: str) -> Any:
    """The field ``name`` of :class:`ReplicaConfig`, defaulting to :data:`EDGE_DEFAULTS` (for the Serve config)."""
    return Field(EDGE_DEFAULTS[name], description=ReplicaConfig.model_fields[name].description)


def _argument_type(name: str, field: FieldInfo, switch_off: bool = False) -> dict[str, Any]:
    """argparse options for a field's annotation: a bool is a switch (with ``switch_off``, also ``--no-...``), a
    Literal gives choices."""
    annotation = field.annotation
    if annotation is bool:
        if field.default is not False:
            raise TypeError(f"{name}: a command-line switch needs default False")
        if not switch_off:
            return {"action": "store_true"}
        return {"action": _NegatedSwitch if name.startswith("no_") else argparse.BooleanOptionalAction}
    if get_origin(annotation) is Literal:
        choices = get_args(annotation)
        return {"type": type(choices[0]), "choices": list(choices)}
    if annotation in (str, int, float):
        return {"type": annotation}
    raise TypeError(f"{name}: no command-line form for {annotation!r}")


class _NegatedSwitch(argparse.Action):
    """A switch whose flag is itself a negation (``--no-cuda-graphs``), with its ``--no-`` stripped form to set it
    back over a configuration file (``--cuda-graphs``). argparse's ``BooleanOptionalAction`` would read any flag
    that starts with ``--no-`` as false."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        plain = ["--" + flag.removeprefix("--no-") for flag in option_strings if flag.startswith("--no-")]
        super().__init__([*option_strings, *plain], dest, nargs=0, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: str | None = None
    ) -> None:
        setattr(namespace, self.dest, bool(option and option.startswith("--no-")))


def _where(config: type[ReplicaConfig], loc: tuple[int | str, ...]) -> str:
    """The flag of the field a validation error is about (or what it is about, when that is no field)."""
    name = str(loc[0]) if loc else "settings"
    return config.flag(name) if name in config.model_fields else name


def validator_words(message: str) -> str:
    """A validation message without pydantic's ``Value error, `` prefix (what our validators said, as said); the
    command line and the HTTP edge both report them so."""
    return message.removeprefix("Value error, ")


def _override_help(over: str, default: Any) -> str:
    """The end of an overriding flag's help: what a left-out flag means."""
    shown = "off" if default is False else default
    return f" (default: {over} value, else {shown})".replace("%", "%%")
