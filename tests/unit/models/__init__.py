"""Unit tests of moeflow.models."""
