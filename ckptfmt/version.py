"""The package's version: one place, read by the package root and by the writers that record
who wrote a file (the manifest's seal)."""
__version__ = "0.1.0"
