"""Static shapes and captured steps: the forward at a few fixed shapes, replayable as CUDA graphs (docs/gpu.md).

``options`` says how the static-shape engine runs (torch-free, for configurations); ``graphs`` records a step once per
key and replays it; ``slots`` holds preallocated KV slots whose blocks pad to a verify bucket (the target's, a draft
model's, an EAGLE head's); ``batch_graphs`` runs a batched step over the KV pool at (rows, width, span) buckets.

Knows the forward (``core.model``) and the KV pool (``core.kv``); not what a step's outputs decide.
"""
