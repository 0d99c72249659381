"""What is measured: model presets and the QLoRA builder, and the training step."""
