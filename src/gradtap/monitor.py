"""``gradtap.Monitor``, importable from here too; the implementation is in ``gradtap._monitor``."""

from gradtap._monitor import DEFAULT_STATS, KINDS, Monitor

__all__ = ["DEFAULT_STATS", "KINDS", "Monitor"]
