"""vramguard inside pytest: the marker plugin and the benchmark plugin (the pytest11 entry points)."""
