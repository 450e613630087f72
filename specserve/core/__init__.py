"""The core: everything one target replica needs to run exact speculative decoding, in one process or on many.

Sampling parameters and warps, the exact acceptance rules (and the one opt-in lossy rule), draft trees, the model
adapter with KV rollback and compaction, tensor-parallel sharding, the drafter, schedule and processor contracts,
structured output, the draft and verify sides of a cycle, how a request starts and streams out
(:mod:`specserve.core.request`), the single-request engine, the KV pool and batched engine, and the static-shape
engine (buckets, preallocated KV slots, CUDA graphs). docs/architecture.md lists every module.

Nothing in ``specserve.core`` imports Ray, gRPC or another part of specserve: the distributed runtime reuses these
objects (the actors drive the same draft and verify sides), and the drafters and policies meet here through contract
types core owns. Core does not choose a drafter or a policy, load the shipped models, or know where processes run.
"""
