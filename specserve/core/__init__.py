"""The core: everything one target replica needs to run exact speculative decoding, in one process or on many.

Its rooms follow one speculation cycle over its state (docs/architecture.md#the-rooms-of-core), lowest first:
``sampling`` (what a request asks of the target's distribution), ``tree`` (what a draft tree is), ``attention`` (the
attention paths), ``kv`` (the state a cycle rolls back: KV caches, recurrent checkpoints, the KV pool, the prefix
cache), ``model`` (the forward over a Hugging Face causal LM, tensor parallelism), ``static`` (static shapes and
captured steps), ``draft`` (the drafter and schedule contracts) and ``verify`` (the exact acceptance rules and what
shapes the distributions they compare). At the top: the two halves of a cycle (``draft_side``, ``target``), a
request's life (``request``, ``prompts``, ``detokenize``, ``stats``, ``resume``, ``shadow``), the engines
(``engine``, ``batch_step``, ``batch_engine``) and ``errors``, which every room may raise.

Nothing in ``specserve.core`` imports Ray, gRPC or another part of specserve: the distributed runtime reuses these
objects (the actors drive the same draft and verify sides), and the drafters and policies meet here through contract
types core owns. Core does not choose a drafter or a policy, load the shipped models, or know where processes run.
"""
