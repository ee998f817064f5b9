"""Parallelism beyond expert dispatch: gradient synchronisation (later: Parm's MP+EP+ESP)."""
