"""fa4gen kernels inside other libraries' models.

- ``fa4gen.integrations.transformers``: ``register()`` adds ``attn_implementation="fa4gen"`` to
  Hugging Face transformers, so ``from_pretrained(..., attn_implementation="fa4gen")`` runs every
  attention layer on fa4gen kernels.

Each integration imports its library only when it is imported itself.
"""
