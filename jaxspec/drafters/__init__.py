"""Drafters: cheap proposers of draft tokens (draft model, n-gram, EAGLE-3, MTP, DFlash)."""
