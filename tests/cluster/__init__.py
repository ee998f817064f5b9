"""Tests on the emulated cluster (network namespaces; marked ``cluster``, need root)."""
