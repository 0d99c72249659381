"""The audit of one QLoRA step: planning, measuring, the verdict, and the report it writes."""
