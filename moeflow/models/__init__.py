"""Models built from moeflow layers."""

from moeflow.models.gpt import GPT

__all__ = ["GPT"]
