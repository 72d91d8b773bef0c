"""macaron-local: a personal AI agent that runs on your own computer and learns from your corrections."""

__version__ = "0.1.0"
