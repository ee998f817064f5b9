"""Unit tests of moeflow.commands."""
