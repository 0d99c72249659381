"""Results over time: benchmark measurements, the results store, and comparing runs (no rendering: views live in :mod:`vramguard.cli`)."""
