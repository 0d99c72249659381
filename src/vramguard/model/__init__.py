"""Expected bytes, from shapes alone: per-layer terms and the whole-model estimate."""
