"""The operator's routes: health, metrics, the cache view and audit clear, the explorer."""
