"""The memory of a QLoRA step at full size, from a meta-device run of the libraries' own code (no GPU,
no weights). :mod:`vramguard.estimate.meta` builds the model and forces the data-dependent decisions,
:mod:`vramguard.estimate.run` runs the step, :mod:`vramguard.estimate.fit` searches what fits. The
command is :mod:`vramguard.cli.estimate`."""
