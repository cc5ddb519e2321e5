"""The kvstore service (installed as ``radixserve.services.kvstore``): the cluster-wide
index of cached pages (`KVStoreService`, settings ``RADIXSERVE_KVSTORE_*``)."""

from radixserve.services.kvstore.service import KVStoreService
from radixserve.services.kvstore.settings import KVStoreSettings

__all__ = ["KVStoreService", "KVStoreSettings"]
