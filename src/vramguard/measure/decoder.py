"""The one decoder-layer rule, for every architecture: a decoder layer is element ``N`` of a
``torch.nn.ModuleList`` attribute called ``layers`` (``model.layers.N`` in Llama, Mistral, Qwen2/3,
Phi-3, Gemma 2/3 and the other decoder-only models of transformers).

Used by the ledger's per-layer grouping (the audit's layer table), the benchmark's per-layer fields
and the ``saved_bytes(per_layer=...)`` marker: by module name where names are known, by structure
(:func:`decoder_layers_of`) where only modules are (a global forward hook).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

_LAYER = re.compile(r"^((?:.*?\.)?layers\.\d+)(?:\.|$)")


def decoder_layer(module: str) -> str | None:
    """``model.layers.3`` for any module under a decoder layer (the outermost ``layers.N``), else None."""
    m = _LAYER.match(module)
    return m.group(1) if m else None


def decoder_layers_of(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """``("layers.N", layer)`` for each decoder layer directly held by ``module`` (the same rule as
    :func:`decoder_layer`, applied to module objects)."""
    layers = module._modules.get("layers")
    if isinstance(layers, torch.nn.ModuleList):
        for index, layer in enumerate(layers):
            yield f"layers.{index}", layer
