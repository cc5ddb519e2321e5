"""The prefill service (installed as ``radixserve.services.prefill``).

`PrefillWorker` computes prompts (only what its own radix cache lacks), samples the
first token and lends the decode worker the pages it asked for; `PrefillSettings`
configures it (``RADIXSERVE_PREFILL_*``).
"""

from radixserve.services.prefill.settings import PrefillSettings
from radixserve.services.prefill.worker import PrefillWorker

__all__ = ["PrefillSettings", "PrefillWorker"]
