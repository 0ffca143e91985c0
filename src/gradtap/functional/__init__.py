"""Explicit functional building blocks (filled in by the convolution issue)."""

__all__: list[str] = []
