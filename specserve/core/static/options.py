"""How the static-shape engine runs (:mod:`specserve.core.static.slots`): its buckets, graphs, compilation and
length. Kept apart from the engine, and free of torch, so that configurations (the command line, the Serve YAML)
can build and check it before any model loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.core.errors import UserError
from specserve.core.model.buckets import VerifyBuckets, default_buckets


@dataclass(frozen=True)
class StaticOptions:
    """How the static-shape engine runs: ``buckets`` (``None``: the device's default), ``cuda_graphs`` (on a CUDA
    device; ignored elsewhere), ``compile`` (``torch.compile`` the model's forward, without its own graphs),
    ``max_len`` (positions a sequence may hold; ``None``: the model's context) and ``row_buckets`` (the batch sizes a
    batched runtime's captured steps pad to, :mod:`specserve.core.static.batch_graphs`; ``None``: powers of two to 256;
    ``()``: no captured batched steps)."""

    buckets: VerifyBuckets | None = None
    cuda_graphs: bool = True
    compile: bool = False
    max_len: int | None = None
    row_buckets: VerifyBuckets | None = None

    def __post_init__(self) -> None:
        if self.max_len is not None and self.max_len < 2:
            raise UserError(f"a static cache holds at least 2 positions, got max_len={self.max_len}")

    def describe(self) -> str:
        buckets = "device default" if self.buckets is None else self.buckets.describe()
        return f"static(buckets={buckets}, cuda_graphs={self.cuda_graphs}, compile={self.compile})"

    def buckets_for(self, device_type: str) -> VerifyBuckets:
        """The buckets blocks pad to on a ``device_type`` device: the given ones, or the device's default."""
        return self.buckets if self.buckets is not None else default_buckets(device_type)

    def resolve(self, device_type: str) -> StaticOptions:
        """These options with the buckets made explicit (:meth:`buckets_for`)."""
        return dataclasses.replace(self, buckets=self.buckets_for(device_type))
