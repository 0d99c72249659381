"""The GPUs people train on, for ``vramguard estimate --gpu NAME``: each card's usable memory and the CUDA
context + kernels allowance the estimate's total adds, measured where this project has a measurement and said
to be assumed, with the basis, where it has none.

A card is a :class:`Gpu` value in :data:`GPUS` (:func:`register` adds one); :func:`gpu_named` finds one by name,
and a name it does not know is one line with the nearest names. Only the context allowance is per card: the
cuBLAS workspaces (torch's own setting) and the fragmentation shares (the caching allocator's) are the H100's
measured figures on every card (docs/estimate.md).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from vramguard.errors import UsageError
from vramguard.estimate.run import CUDA_CONTEXT_BYTES

MiB = 1 << 20

H100_CONTEXT = (
    f"{CUDA_CONTEXT_BYTES // MiB} MiB measured on an H100 (NVML, CUDA 13); outside the allocator, varies by GPU "
    "and driver"
)
"""The basis of the H100's allowance, as the estimate has always said it (docs/measurements/2026-11-22-h100)."""

ASSUMED_CONTEXT = (
    f"not measured on this card, assumed from the H100's {CUDA_CONTEXT_BYTES // MiB} MiB (NVML, CUDA 13, torch + "
    "bitsandbytes kernels); other cards, drivers and CUDA versions differ by a few hundred MiB"
)
"""The basis of every allowance this project has not measured on the card itself."""


@dataclass(frozen=True)
class Gpu:
    """One card: ``name`` (the registry's key: lowercase letters and digits), ``label`` (as a person writes it),
    ``memory_mib`` (the memory.total nvidia-smi reports: what the process, context included, must fit in) with
    ``memory_basis``, ``context_bytes`` with ``context_basis``, ``compute_capability`` (bf16 and FlashAttention-2
    need 8.0), and other spellings of the name in ``aliases``."""

    name: str
    label: str
    memory_mib: int
    memory_basis: str
    compute_capability: tuple[int, int]
    context_bytes: int = CUDA_CONTEXT_BYTES
    context_basis: str = ASSUMED_CONTEXT
    aliases: tuple[str, ...] = ()

    @property
    def usable_bytes(self) -> int:
        """The memory the run's whole process must fit in: ``--fit --gpu NAME``'s size."""
        return self.memory_mib * MiB

    @property
    def measured(self) -> bool:
        """Whether both figures were measured on this card (by this project)."""
        return not self.memory_basis.startswith("not measured") and not self.context_basis.startswith(
            "not measured"
        )

    @property
    def context_note(self) -> str:
        """The context allowance's standing in a few words, for the estimate's line."""
        how = "assumed from the H100's" if self.context_basis.startswith("not measured") else "measured"
        return f"{self.label} context {how}"

    @property
    def has_bf16(self) -> bool:
        """bf16 autocast and FlashAttention-2 need compute capability 8.0 (Ampere) or newer."""
        return self.compute_capability >= (8, 0)


GPUS: dict[str, Gpu] = {}
"""Every registered card by :attr:`Gpu.name`."""


def register(gpu: Gpu) -> Gpu:
    """Add ``gpu`` to :data:`GPUS` (its name and aliases must be new); returns it."""
    keys = (gpu.name, *gpu.aliases)
    for key in keys:
        if key != _key(key) or key in _ALIASES or keys.count(key) > 1:
            raise ValueError(f"GPU name {key!r} is taken or not in canonical form ({_key(key)!r})")
    _ALIASES.update(dict.fromkeys(keys, gpu.name))
    GPUS[gpu.name] = gpu
    return gpu


_ALIASES: dict[str, str] = {}


def _key(text: str) -> str:
    """A card's name as the registry keys it: lowercase letters and digits ("RTX 4090" -> "rtx4090")."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def gpu_named(text: str) -> Gpu:
    """The registered card ``text`` names (any case, spaces, dashes: "RTX 4090", "rtx-4090", "a100-80gb");
    UsageError naming the nearest names otherwise."""
    key = _key(text)
    if key in _ALIASES:
        return GPUS[_ALIASES[key]]
    near = difflib.get_close_matches(key, sorted(_ALIASES), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(dict.fromkeys(_ALIASES[n] for n in near))}? " if near else ""
    raise UsageError(f"unknown GPU {text[:40]!r}: {hint}known: {', '.join(GPUS)}")


def _assumed_memory(reported: str) -> str:
    return f"not measured by this project: the memory.total nvidia-smi reports for this card ({reported})"


# -- the cards --------------------------------------------------------------------------------------------------

register(
    Gpu(
        "h100",
        "H100 80GB",
        81559,
        "measured: nvidia-smi's memory.total on the project's H100 80GB HBM3 (docs/measurements/2026-11-22-h100)",
        (9, 0),
        context_basis=H100_CONTEXT,
        aliases=("h10080gb", "h100sxm", "h100pcie"),
    )
)
register(
    Gpu(
        "h200",
        "H200",
        143771,
        "measured: nvidia-smi's memory.total on the project's H200 (docs/measurements/2026-11-27-h200)",
        (9, 0),
        context_basis="not measured on the H200 (its runs read the allocator only), assumed from the H100's "
        f"{CUDA_CONTEXT_BYTES // MiB} MiB: the same Hopper chip, driver 580 and CUDA 13",
        aliases=("h200141gb", "h200sxm"),
    )
)
register(Gpu("a10080gb", "A100 80GB", 81920, _assumed_memory("80 GiB"), (8, 0), aliases=("a100",)))
register(Gpu("a10040gb", "A100 40GB", 40960, _assumed_memory("40 GiB"), (8, 0)))
register(Gpu("l40s", "L40S", 46068, _assumed_memory("48 GB less ECC's share"), (8, 9)))
register(
    Gpu("a6000", "RTX A6000", 49140, _assumed_memory("48 GB less ECC's share"), (8, 6), aliases=("rtxa6000",))
)
register(Gpu("a10", "A10", 23028, _assumed_memory("24 GB less ECC's share"), (8, 6), aliases=("a10g",)))
register(Gpu("l4", "L4", 23034, _assumed_memory("24 GB less ECC's share"), (8, 9)))
register(Gpu("rtx5090", "GeForce RTX 5090", 32607, _assumed_memory("32 GB"), (12, 0), aliases=("5090",)))
register(Gpu("rtx4090", "GeForce RTX 4090", 24564, _assumed_memory("24 GB"), (8, 9), aliases=("4090",)))
register(Gpu("rtx3090", "GeForce RTX 3090", 24576, _assumed_memory("24 GB"), (8, 6), aliases=("3090",)))
register(Gpu("t4", "T4", 15360, _assumed_memory("16 GB less ECC's share"), (7, 5)))
