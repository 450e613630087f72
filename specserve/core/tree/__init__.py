"""Draft trees: the shapes a request asks for (``shapes``: static topologies, dynamic budgets; torch-free) and the
tree every drafter produces and the target verifies in one pass (``draft_tree``: nodes, parents, each parent's q,
the tree attention mask).

A chain is the tree with one child per node. Knows nothing of models or KV: the model adapter
(``core.model``) turns a tree into a forward, the verifier (``core.verify.tree``) walks it.
"""
