"""Single-process tests, one folder per moeflow package (``core`` holds the top-level modules)."""
