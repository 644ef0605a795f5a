"""Pallas kernels, one folder each: reference.py (pure-jnp oracle), kernel_{gpu,tpu}.py, and an
__init__.py that dispatches between them. On CPU the library runs the XLA reference path; the
kernels are tested in interpret mode (see each folder's docstring for what has run on hardware).
"""
