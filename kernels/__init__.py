"""Compute kernels, installed as ``radixserve.kernels``.

``reference/`` holds the plain-torch specification of every op (it runs anywhere);
``triton/`` holds Triton kernels with the same signatures. ``ops`` registers both sets by
name and picks one per process. Imports go one way: this package uses torch and triton
only (``bench.py``, a script, is the one file that drives the engine).
"""
