"""What is measured: model presets, architecture families, the QLoRA builder, and the training step."""
