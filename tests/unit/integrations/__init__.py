"""Unit tests of moeflow.integrations."""
