"""The autoscaler service (installed as ``radixserve.services.autoscaler``): holds the TTFT
and ITL SLOs by sizing the prefill and decode pools (`AutoscalerService`, settings
``RADIXSERVE_AUTOSCALER_*``; the decisions are `policy.ScalingPolicy`'s)."""

from radixserve.services.autoscaler.service import AutoscalerService
from radixserve.services.autoscaler.settings import AutoscalerSettings

__all__ = ["AutoscalerService", "AutoscalerSettings"]
