"""One training step's shared pieces, which the audit (a step on a device), the estimate (the step on meta) and the
Trainer integrations all build on: the report schema, the verdict's checks and report assembly."""
