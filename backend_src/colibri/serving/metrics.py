"""colibri_moe's custom metrics through the Python backend: tokens per expert
(colibri_expert_tokens_total) and the time of each batch's forwards (colibri_forward_seconds). With
a folder of layers both carry a `layer` label (the N of layer{N}.colibri.safetensors) and a batch's
time is observed per layer, for the forwards of its requests naming that layer.

Custom metrics came to the Python backend in 23.05, histograms later still: tritonserver 22.12 (the
CUDA 11.8 image) serves without the ones it lacks. Each metric update is a round trip to
tritonserver (about 20 us on the CI machine): one per touched expert after every batch cost a
64-expert layer about 1 ms per batch, so the counts gather here and go out at most once per
interval, with the next batch after it.
"""
import time

import numpy as np

FORWARD_SECONDS_BUCKETS = [1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0]


class ModelMetrics:
    """The metrics of one model instance. pb_utils: triton_python_backend_utils (or a stand-in);
    experts: {layer number: number of experts}, one entry of key None for a single file (no label)."""

    def __init__(self, pb_utils, labels: dict, experts: dict, interval: float):
        self.interval = interval
        self.expert_tokens, self.forward_seconds = {n: [] for n in experts}, {}
        self.unflushed = {n: np.zeros(count, np.uint64) for n, count in experts.items()}
        self.last_flush = time.monotonic()
        layer_labels = {n: labels if n is None else {**labels, "layer": str(n)} for n in experts}
        families = getattr(pb_utils, "MetricFamily", None)
        # The families must outlive their metrics: the backend refuses to update orphaned ones.
        if families is not None:
            self.tokens_family = families(
                name="colibri_expert_tokens_total",
                description="Tokens routed to each expert (one count per token and chosen expert)",
                kind=families.COUNTER)
            self.expert_tokens = {n: [self.tokens_family.Metric(labels={**layer_labels[n], "expert": str(e)})
                                      for e in range(count)] for n, count in experts.items()}
        if hasattr(families, "HISTOGRAM"):
            self.seconds_family = families(
                name="colibri_forward_seconds",
                description="Time to compute one batch of requests: its MoE forwards until the device is done",
                kind=families.HISTOGRAM)
            self.forward_seconds = {n: self.seconds_family.Metric(labels=layer_labels[n],
                                                                  buckets=FORWARD_SECONDS_BUCKETS) for n in experts}

    def batch_done(self, layer, expert_counts, seconds: float) -> None:
        """Counts the (token, expert) assignments of a batch's requests for `layer` (None: a single
        file) and their time; flushes when the interval is over."""
        self.unflushed[layer] += expert_counts
        if layer in self.forward_seconds:
            self.forward_seconds[layer].observe(seconds)
        if time.monotonic() - self.last_flush >= self.interval:
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        for layer, counts in self.unflushed.items():
            self.unflushed[layer] = np.zeros_like(counts)
            for metric, count in zip(self.expert_tokens.get(layer, []), counts.tolist()):
                if count:
                    metric.increment(count)
