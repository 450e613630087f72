"""Training of the shipped default model pair: tokenizer, target pre-training, draft distillation.

Nothing here is imported by the serving path; it only produces checkpoint directories under
``models/`` that the rest of specserve loads like any other local Hugging Face checkpoint.
"""
