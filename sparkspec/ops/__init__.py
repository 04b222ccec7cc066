from sparkspec.ops.registry import native_ops, ops

__all__ = ["ops", "native_ops"]
