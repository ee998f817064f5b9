"""Checks of the documents: README.md's commands and links, docs/design.md's example."""
