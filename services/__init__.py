"""Service processes (gateway, prefill, decode, kvstore), installed as ``radixserve.services``."""
