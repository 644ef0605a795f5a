"""Training: packed data from text corpora, losses and the resumable trainer."""
