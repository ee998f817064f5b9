"""Sub-commands of the ``moeflow`` CLI, one module each (``register(subparsers)``)."""
