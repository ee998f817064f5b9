"""Unit tests of moeflow.strategies.fssdp."""
