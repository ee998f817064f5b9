"""Node-deduplicated dispatch and combine (DeepEP's inter-node dispatch, Megatron-core's flex
dispatcher; SMILE Section 3.2.3 made token-aware): the strategy in :mod:`.strategy`, its
chunked steps in :mod:`.steps`, the relay's hops overlapped per source node in :mod:`.overlap`
(trimmed), the padded mode in :mod:`.padded` with its capacity per
destination node in :mod:`.node_capacity`, and the scheduled backward in :mod:`.backward`."""
