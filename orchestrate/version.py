"""The package version, alone in its module so that anything may import it cheaply."""

__version__ = "0.1.0"
