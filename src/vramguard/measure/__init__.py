"""Measuring memory: torch only (no rich, argparse or pytest). Storages, the saved-tensor ledger, the live tracker, the decoder-layer rule, and the meters the pytest markers use."""
