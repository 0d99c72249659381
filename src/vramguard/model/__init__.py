"""Expected bytes, from shapes alone: per-layer terms, the whole-model estimate, and the architecture families it covers."""
