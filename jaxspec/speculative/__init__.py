"""Speculative decoding core: sampling, verification, engine and metrics."""
