"""Samples, batches and the sources their lengths come from."""

from megatron_dhp.workload.batches import LengthSource, fit_to_domain, truncate_sample
from megatron_dhp.workload.sample import Batch, Sample, VisualItem
from megatron_dhp.workload.sources import load_samples
from megatron_dhp.workload.synthetic import DISTRIBUTIONS, Distribution, get_distribution

__all__ = [
    "DISTRIBUTIONS",
    "Batch",
    "Distribution",
    "LengthSource",
    "Sample",
    "VisualItem",
    "fit_to_domain",
    "get_distribution",
    "load_samples",
    "truncate_sample",
]
