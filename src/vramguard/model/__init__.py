"""Expected bytes, from shapes alone: per-layer terms (``layers``) and the whole step (``analytic``: the
analytic model, and the plan of a configuration before anything is built)."""
