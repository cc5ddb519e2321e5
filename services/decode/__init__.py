"""The decode service (installed as ``radixserve.services.decode``).

`DecodeWorker` runs continuous-batching decode over its own radix cache, prefilling
locally when little is missing and through a prefill worker otherwise;
`DecodeSettings` configures it (``RADIXSERVE_DECODE_*``).
"""

from radixserve.services.decode.settings import DecodeSettings
from radixserve.services.decode.worker import DecodeWorker

__all__ = ["DecodeSettings", "DecodeWorker"]
