"""The fast products, one home per kind: ``linear`` (a weight back-end a file, and the table that
picks one for a weight) and ``moe`` (the strategies that run a layer's chosen experts)."""
