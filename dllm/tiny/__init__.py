"""Tiny-model training: the project's tokenizer, the masked-diffusion trainer (LLaDA / Dream formats) and the
autoregressive guide's trainer, on the synthetic tasks of :mod:`dllm.evals.tasks`. ``dllm train-tiny`` runs them;
the bundled checkpoints in :mod:`dllm.assets` were made with them."""
