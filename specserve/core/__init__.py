"""The single-process core: sampling warps, exact verification, the model adapter and the engine loop.

Nothing in ``specserve.core`` imports Ray or gRPC; the distributed runtime reuses these functions.
"""
