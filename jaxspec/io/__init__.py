"""Input/output: tokenizers, Hugging Face import/export and checkpoints."""
