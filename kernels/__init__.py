"""Compute kernels, installed as ``radixserve.kernels``.

``reference/`` holds plain-torch specifications that run anywhere; Triton versions with
the same signatures live in ``triton/``.
"""
