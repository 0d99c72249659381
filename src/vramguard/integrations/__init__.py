"""Integrations with training frameworks (``vramguard.integrations.transformers``: Trainer / SFTTrainer)."""
