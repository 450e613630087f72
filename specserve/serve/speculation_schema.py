"""The ``speculation`` extension of the request bodies: how one request drafts, validated at the HTTP edge.

:class:`SpeculationOptions` is the ``speculation`` object, a field of every completion and chat request and no
OpenAI field: drafting on or off; γ (at most :data:`~specserve.core.draft.schedule.MAX_GAMMA`); the drafter (the
deployment's configured one, ``ngram``, ``suffix``, ``lookahead`` or ``none``: a draft model cannot be chosen per
request); the draft shape, a chain (:class:`ChainTree`), a dynamic tree within a budget (:class:`DynamicTree`) or a
static topology (:class:`StaticTree`) of :mod:`specserve.core.tree.draft_tree`, bounded by :data:`MAX_TREE_DEPTH`,
:data:`MAX_TREE_WIDTH` and :data:`MAX_TREE_NODES` so that no request can ask for a giant tree; the policy;
drafter-invariant sampling (:mod:`specserve.core.verify.invariant`); and the acceptance rule: exact, or Medusa's *lossy*
typical acceptance (:mod:`specserve.core.verify.typical`), refused unless ``lossy`` is true as well. Does not: turn the
options into engine settings (the request does: :meth:`~specserve.serve.schemas.CompletionRequest.sampling` and
:meth:`~specserve.serve.schemas.CompletionRequest.generation`), hold the OpenAI fields
(:mod:`specserve.serve.schemas`), or report what speculation did (the answer's ``speculation`` summary:
:mod:`specserve.serve.openai_api`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, ValidatorFunctionWrapHandler, field_validator

from specserve.core.draft.schedule import MAX_GAMMA
from specserve.core.sampling.params import TYPICAL_DELTA, TYPICAL_EPSILON
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.serve.errors import STRICT, tagged_union_error

# The largest draft tree a request may ask for: every node is a position of the target's verify pass.
MAX_TREE_DEPTH = 16
MAX_TREE_WIDTH = 8
MAX_TREE_NODES = 64


class ChainTree(BaseModel):
    """``{"kind": "chain"}``: one chain of ``gamma`` draft tokens per cycle (the default)."""

    model_config = STRICT

    kind: Literal["chain"] = Field(..., description="a chain of gamma draft tokens per cycle")

    def spec(self) -> TreeSpec | None:
        return None


class DynamicTree(BaseModel):
    """``{"kind": "dynamic", ...}``: a tree grown per cycle within a budget, as EAGLE-2 does."""

    model_config = STRICT

    kind: Literal["dynamic"] = Field(..., description="a tree grown each cycle from the draft's confidence")
    depth: int = Field(4, ge=1, le=MAX_TREE_DEPTH, description="levels below the last committed token")
    width: int = Field(2, ge=1, le=MAX_TREE_WIDTH, description="children per expanded node")
    nodes: int = Field(8, ge=1, le=MAX_TREE_NODES, description="draft nodes kept for verification")
    expand: int | None = Field(
        None, ge=1, le=MAX_TREE_WIDTH, description="nodes expanded per level (default: width; 1 = cheapest drafting)"
    )

    def spec(self) -> TreeSpec:
        return TreeSpec("dynamic", budget=TreeBudget(self.depth, self.width, self.nodes, self.expand))


TreeRank = Annotated[int, Field(ge=0, lt=MAX_TREE_NODES)]  # which candidate of its parent: 0 = the best
TreePath = Annotated[list[TreeRank], Field(min_length=1, max_length=MAX_TREE_DEPTH)]


class StaticTree(BaseModel):
    """``{"kind": "static", "paths": [[0], [1], [0, 0]]}``: one fixed topology as index paths (Medusa's form)."""

    model_config = STRICT

    kind: Literal["static"] = Field(..., description="the same tree shape every cycle")
    paths: list[TreePath] = Field(
        ...,
        min_length=1,
        max_length=MAX_TREE_NODES,
        description=(
            "one index path per node: [0] = the root's best child, [0, 1] = that child's second-best child...;"
            " every path's parent path must be listed too"
        ),
    )

    @field_validator("paths")
    @classmethod
    def _topology(cls, paths: list[list[int]]) -> list[list[int]]:
        TreeTopology.from_lists(paths)  # raises InvalidTree, a ValueError: a path twice, a missing parent path...
        return paths

    def spec(self) -> TreeSpec:
        return TreeSpec("static", topology=TreeTopology.from_lists(self.paths))


TREE_KINDS = ("chain", "dynamic", "static")
TreeOptions = Annotated[ChainTree | DynamicTree | StaticTree, Field(discriminator="kind")]


class SpeculationOptions(BaseModel):
    """The ``speculation`` extension object: how this request drafts."""

    model_config = STRICT

    enabled: bool = Field(True, description="draft and verify (true) or decode plainly (false); output is the same")
    gamma: int | None = Field(
        None, ge=1, le=MAX_GAMMA, description="draft tokens per cycle; default: the deployment's configured gamma"
    )
    drafter: Literal["default", "ngram", "suffix", "lookahead", "none"] = Field(
        "default",
        description=(
            "who drafts: the deployment's configured drafter (default), prompt-lookup n-grams (ngram), suffix"
            " decoding over this and recent requests (suffix), the target's own Jacobi iterations (lookahead), or"
            " nobody (none: plain decoding); output is the same, only speed differs"
        ),
    )
    tree: TreeOptions = Field(
        default_factory=lambda: ChainTree(kind="chain"),
        description=(
            'the draft shape: {"kind": "chain"} (default; gamma tokens), {"kind": "dynamic", "depth": 4,'
            ' "width": 2, "nodes": 8} (EAGLE-2 budget; gamma unused) or {"kind": "static", "paths": [[0], [1],'
            f" [0, 0]]}} (a fixed topology); at most depth {MAX_TREE_DEPTH}, width {MAX_TREE_WIDTH},"
            f" {MAX_TREE_NODES} nodes; output is the same, only speed differs"
        ),
    )
    policy: Literal["default", "fixed", "heuristic", "adaptive"] = Field(
        "default",
        description=(
            "how much to draft each cycle: the deployment's configured policy (default), gamma (or the tree) every"
            " cycle (fixed), transformers' +2/-1 schedule from gamma (heuristic), or the gamma that maximises"
            " predicted tokens/s from online estimates of acceptance and cost, 0 = plain decoding (adaptive);"
            " output is the same, only speed differs"
        ),
    )
    drafter_invariant: bool | None = Field(
        None,
        description=(
            "sample so that the output for a seed is the same whatever the drafter, gamma or tree (keyed"
            " Gumbel noise; accepts fewer drafts than the default rejection sampling); no effect at temperature 0;"
            " left out: the deployment's drafter_invariant setting (false unless the operator set it)"
        ),
    )

    acceptance: Literal["exact", "typical"] = Field(
        "exact",
        description=(
            "how drafts are accepted: exact (the output is distributed as the target's) or typical (Medusa's"
            " typical acceptance: LOSSY, the output is no longer the target's; needs lossy: true)"
        ),
    )
    lossy: bool = Field(
        False,
        validate_default=True,  # so that typical acceptance without lossy is refused here, at speculation.lossy
        description="allow a lossy acceptance rule (acceptance: typical); the answer then says lossy: true",
    )
    typical_epsilon: float = Field(
        TYPICAL_EPSILON, gt=0.0, lt=1.0, description="typical acceptance: accept x when p(x) > min(epsilon, ...)"
    )
    typical_delta: float = Field(
        TYPICAL_DELTA, gt=0.0, le=1.0, description="typical acceptance: ... min(epsilon, delta * exp(-entropy(p)))"
    )

    @field_validator("acceptance")
    @classmethod
    def _exact_or_invariant(cls, acceptance: str, info: ValidationInfo) -> str:
        if acceptance == "typical" and info.data.get("drafter_invariant"):
            raise ValueError("typical acceptance cannot be combined with drafter_invariant (which is exact)")
        return acceptance

    @field_validator("lossy")
    @classmethod
    def _lossy_opt_in(cls, lossy: bool, info: ValidationInfo) -> bool:
        if info.data.get("acceptance") == "typical" and not lossy:
            raise ValueError(
                "typical acceptance is lossy (the output is no longer distributed as the target's);"
                " opt in with speculation.lossy: true"
            )
        return lossy

    @field_validator("tree", mode="wrap")
    @classmethod
    def _one_tree_error(cls, tree: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """Every fault inside the tree object is reported at ``speculation.tree``, the inner field named in the
        message (pydantic's own locations would contain the union's tag, which is no key of the JSON)."""
        try:
            return handler(tree)
        except ValidationError as exc:
            raise tagged_union_error(exc, "kind", TREE_KINDS) from exc
