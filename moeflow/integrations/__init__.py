"""Bridges between moeflow and other libraries (optional dependencies, imported on use)."""
