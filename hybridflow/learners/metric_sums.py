"""Reduce per-micro-batch training metrics to one number each, over micro-batches and ranks."""

from __future__ import annotations

import math

import torch

from hybridflow.learners.core import TrainCore


class MetricSums:
    """Accumulates three kinds of metrics during an update:

    - mini-batch terms (losses computed with global counts): each micro-batch value is its share,
      so the sum over micro-batches and ranks is the mini-batch value; reported as the mean over
      optimizer steps.
    - token means (clip fractions, ppo_kl, …): averaged weighted by the micro-batch's tokens.
    - per-step values: ``grad_norm`` (mean over the steps that were taken) and skipped steps.
    Values stay tensors on their device until :meth:`result`, which does one all-reduce and
    one host sync (a ``.cpu()`` per micro-batch would stall the host on every micro-batch).
    """

    def __init__(self, core: TrainCore):
        self.core = core
        self.terms: dict[str, torch.Tensor] = {}
        self.weighted: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}
        self.steps = 0
        self.skipped = 0
        self.grad_norm_sum = 0.0
        self.last_lr = 0.0

    def add_mini_batch_terms(self, terms: dict[str, torch.Tensor]) -> None:
        for name, value in terms.items():
            value = torch.as_tensor(value).detach().reshape(()).double()
            self.terms[name] = self.terms.get(name, 0.0) + value

    def add_token_means(self, means: dict[str, torch.Tensor], weight: float) -> None:
        for name, value in means.items():
            value = torch.as_tensor(value).detach().reshape(()).double()
            self.weighted[name] = self.weighted.get(name, 0.0) + value * weight
            self.weights[name] = self.weights.get(name, 0.0) + weight

    def add_step(self, grad_norm: float, skipped: bool) -> None:
        self.steps += 1
        if skipped:
            self.skipped += 1
        else:
            self.grad_norm_sum += grad_norm

    def result(self) -> dict[str, float]:
        term_names = sorted(self.terms)
        mean_names = sorted(self.weighted)
        device = self.core.comm_device()
        flat = [torch.as_tensor(self.terms[n]).to(device) for n in term_names]
        flat += [torch.as_tensor(self.weighted[n]).to(device) for n in mean_names]
        flat += [
            torch.tensor(self.weights[n], dtype=torch.float64, device=device) for n in mean_names
        ]
        reduced = torch.stack(flat) if flat else torch.zeros(0, dtype=torch.float64, device=device)
        values = self.core.all_reduce(reduced).tolist()
        out: dict[str, float] = {}
        for i, name in enumerate(term_names):
            out[name] = values[i] / max(self.steps, 1)
        offset = len(term_names)
        for i, name in enumerate(mean_names):
            weight = values[offset + len(mean_names) + i]
            out[name] = values[offset + i] / weight if weight > 0 else 0.0
        taken = self.steps - self.skipped
        out["grad_norm"] = self.grad_norm_sum / taken if taken else math.nan
        return out
