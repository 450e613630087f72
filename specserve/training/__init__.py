"""Training: the shipped default pair, drafter heads for a frozen target, and the REST drafter's token datastore.

The default pair (:mod:`~specserve.training.pipeline`): tokenizer, target pre-training, draft distillation and its
model card. Heads for a frozen target: EAGLE (:mod:`~specserve.training.eagle`), Medusa
(:mod:`~specserve.training.medusa`) and the layer-skip exit head (:mod:`~specserve.training.exit_head`), sharing
:mod:`~specserve.training.heads` and one training loop (:mod:`~specserve.training.loop`). The REST drafter's datastore
(:mod:`~specserve.training.datastore`, the ``specserve datastore`` subcommand). The ``specserve train`` subcommand is
:mod:`~specserve.training.command`.

Nothing here is imported by the serving path; it only writes checkpoint directories and files (the shipped pair's under
``models/``) that the rest of specserve loads like any other local Hugging Face checkpoint or datastore.
"""
