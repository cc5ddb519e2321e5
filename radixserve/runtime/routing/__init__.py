"""The cluster gateway's routing: `ClusterClient` (decode workers, migration), `DecodeRouter`."""
