"""Envoy external processor that sheds load when every LLM worker is busy."""

__version__ = "0.1.0"
