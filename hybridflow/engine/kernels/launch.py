"""How the Triton decode kernels are launched (Launch), resolved once per engine from its
options and device. Needs only torch (the torch backend runs without Triton)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch

_KEYWORDS = {"PDL": True, "launch_pdl": True}


@dataclass(frozen=True)
class Launch:
    """How the decode kernels are launched: resolved once per engine from its options and its
    device (launch_for), then passed to every kernel wrapper.

    pdl: kernels with a `PDL` constexpr launch with programmatic dependent launch.
    pair_pdl: the shared-prefix pair (row kernel, prefix kernel) links with PDL even where
        `pdl` is off for the layer around it (the split decode layer: its cuBLAS matmuls
        break every other link, and PDL measured 0-2.5% slower there).
    prefetch_weights: with PDL, a matmul asks L2 for the start of its weight before it waits.
    tma: gemm tiles come through TMA tensor descriptors where the operands allow it."""

    pdl: bool = False
    pair_pdl: bool = False
    prefetch_weights: bool = False
    tma: bool = False

    def keywords(self) -> dict:
        """Launch keywords of a kernel with a `PDL` constexpr: {} where PDL is off."""
        return dict(_KEYWORDS) if self.pdl else {}

    def pair_keywords(self) -> dict:
        return dict(_KEYWORDS) if self.pair_pdl else {}

    def without_pdl(self) -> Launch:
        """Plain launches for this layer (the shared-prefix pair keeps its own link)."""
        return replace(self, pdl=False)


PLAIN = Launch()


@functools.lru_cache(maxsize=8)
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """PDL works on this device: CUDA, compute capability >= 9, a Triton with GDC."""
    if device.type != "cuda" or not _device_supports(device.index or 0):
        return False
    from hybridflow.engine.kernels.pdl import SUPPORTED

    return SUPPORTED


def tma_default(device: torch.device) -> bool:
    """TMA loads by default: on sm_90+ GPUs and under the Triton interpreter (CPU tests)."""
    if device.type == "cuda":
        return _device_supports(device.index or 0)
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch_for(device: torch.device, pdl: bool | None = None, prefetch_weights: bool = True,
               tma: bool | None = None) -> Launch:  # fmt: skip
    """The Launch of an engine on `device`: pdl None = wherever supported; True where it is
    not supported raises (a forced choice that cannot hold); tma None = tma_default."""
    capable = supported(device)
    if pdl and not capable:
        raise ValueError(
            f"pdl=True: programmatic dependent launch needs an sm_90+ CUDA device and "
            f"Triton >= 3.4, not {device}; leave it None (auto) or set False"
        )
    use = capable if pdl is None else bool(pdl)
    return Launch(pdl=use, pair_pdl=use, prefetch_weights=use and prefetch_weights,
                  tma=tma_default(device) if tma is None else bool(tma))  # fmt: skip
