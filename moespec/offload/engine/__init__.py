"""The real back end of the layer driver: a host store, a device slot pool and a copy thread."""
