"""ckpttool's version: a ground module (no imports), so any layer can name it without
importing the library API."""

__version__ = "0.1.0"
