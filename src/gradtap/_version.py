"""The package's version, in a module of its own so that any layer can read it without
importing the package root (and through it every consumer)."""

__all__ = ["__version__"]

__version__ = "0.1.0"
