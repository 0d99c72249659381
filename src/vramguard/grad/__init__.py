"""Gradient correctness: cases and strategies, the reference math, tolerances, patches, capability probes, and the runner that checks them."""
