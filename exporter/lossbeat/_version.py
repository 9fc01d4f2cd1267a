"""The package version, on its own so modules read it without importing the package."""

__version__ = "0.1.0"
