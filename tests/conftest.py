"""Set-up that must come before any test module is imported.

The Triton kernels' tests need triton imported in the interpreter mode on CPU, and
transformers imports triton as a side effect: see `tests/kernels/interpreter.py`.
"""

from tests.kernels.interpreter import import_kernels

import_kernels()
