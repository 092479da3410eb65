"""Continuous (iteration-level) batching over an AttentionTier: many requests in flight at once, each
step either one request's prefill or one decode forward of the running sequences together, so a new
prompt waits behind at most one step, not behind the whole decode of every earlier request.

    batcher = ContinuousBatcher(tier, max_batch=32)
    handle = batcher.submit([1, 2, 3], max_new_tokens=16)
    while not handle.done:
        batcher.step()
    handle.result          # BatchedResult: tokens, ttft_s (from arrival), tpot_s, prompt_tokens, wait_s

Policy: prefill first. The oldest waiting request is prefilled alone, exactly as AttentionTier.generate
prefills (its own DynamicCache), and joins the running sequences with its first token; with none waiting,
one decode forward takes the oldest max_batch running sequences (the others wait their turn). The
batch's KV cache is one DynamicCache whose rows are left-padded to the longest, rebuilt only when a
sequence joins or leaves; a 2-D attention mask hides the padding and each row gets its own position.
run_open_loop drives a batcher from a schedule of arrivals (bench/bench_ttft.py)."""
import collections
import dataclasses
import itertools
import time

import torch

from colibri._native import invalid
from colibri.attention.tier import GenerateResult


@dataclasses.dataclass
class BatchedResult(GenerateResult):
    """GenerateResult of a request the batcher served; its ttft_s counts from the request's arrival.

    wait_s: seconds from the arrival to the start of its prefill (its time in the queue)."""
    wait_s: float


class Request:
    """A submitted request. tokens grow as they are read to the host; the clocks (the batcher's) of its
    arrival, prefill start (started), first token (first) and latest token (last); result once it has
    all its tokens, or error (one line) if a forward it was in failed."""

    def __init__(self, number, prompt, max_new_tokens, arrival):
        self.number, self.prompt, self.max_new_tokens, self.arrival = number, prompt, max_new_tokens, arrival
        self.tokens, self.started, self.first, self.last = [], None, None, None
        self.cache = None  # its own DynamicCache, from its prefill until it joins the batch's
        self.result, self.error = None, None

    @property
    def done(self):
        return self.result is not None or self.error is not None

    @property
    def length(self):
        """Tokens in its KV cache: the prompt and every new token but the latest (fed at the next step)."""
        return len(self.prompt) + len(self.tokens) - 1

    def __repr__(self):
        return f"Request({self.number}, {len(self.prompt)} prompt tokens, {len(self.tokens)}/{self.max_new_tokens})"


class ContinuousBatcher:
    """Serves submitted requests over `tier` (an AttentionTier) one step() at a time.

    Parameters
    ----------
    tier : AttentionTier
        Its model, expert tier and device; the batcher calls the model as AttentionTier.generate does.
    max_batch : int
        The most sequences in one decode forward (1: no batched decode, requests still interleave).
    clock : callable
        Seconds, for arrivals and token times (time.perf_counter; a fake one in tests)."""

    def __init__(self, tier, max_batch=32, clock=time.perf_counter):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer
        if int(max_batch) < 1:
            raise invalid(f"max_batch: expected at least 1, got {max_batch}")
        self.tier, self.clock = tier, clock
        self._new_cache = lambda: DynamicCache(config=tier.model.config)
        # Rows of a plain full-attention cache can be left-padded and stacked; a sliding-window layer
        # (gpt_oss) or any other kind keeps its own state per sequence, so those decode one at a time.
        self.batchable = all(type(layer) is DynamicLayer for layer in self._new_cache().layers)
        self.max_batch = int(max_batch) if self.batchable else 1
        self._numbers = itertools.count()
        self._waiting = collections.deque()  # submitted, not prefilled, oldest first
        self._running = []  # prefilled and unfinished, in the order they joined
        self._batch = []  # the rows of self._cache, always a prefix of self._running
        self._cache, self._width = None, 0  # the batch's cache and its padded length
        self.decode_steps = self.decoded_rows = 0  # mean running batch = decoded_rows / decode_steps

    @property
    def waiting(self):
        return len(self._waiting)

    @property
    def running(self):
        return len(self._running)

    @property
    def batch(self):
        """The requests of the batch's cache, in row order (those the next decode forward takes, until one
        joins)."""
        return list(self._batch)

    @property
    def idle(self):
        return not self._waiting and not self._running

    def submit(self, prompt_ids, max_new_tokens, arrival=None):
        """Queues a request and returns its Request; arrival (the batcher's clock) defaults to now. A bad
        prompt or max_new_tokens is refused in one line (ColibriError) and nothing is queued."""
        ids = self.tier.check_prompt(prompt_ids)
        try:
            new = int(max_new_tokens)
        except (TypeError, ValueError):
            new = 0
        if new < 1:
            raise invalid(f"max_new_tokens: expected at least 1, got {max_new_tokens}")
        request = Request(next(self._numbers), ids, new, self.clock() if arrival is None else arrival)
        self._waiting.append(request)
        return request

    def oldest_wait(self, now=None):
        """Seconds the longest-waiting unprefilled request has waited since its arrival (0.0: none waits)."""
        now = self.clock() if now is None else now
        return max((now - r.arrival for r in self._waiting), default=0.0)

    def cancel_waiting(self):
        """Drops every request not yet prefilled (their error says so) and returns them."""
        dropped = list(self._waiting)
        self._waiting.clear()
        for request in dropped:
            request.error = "cancelled before its prefill"
        return dropped

    def step(self):
        """One iteration: the oldest waiting request's prefill, else one decode forward of the batch.
        Returns "prefill", "decode" or None (nothing to do). A forward that raises fails the requests in
        it (their error) and raises; the others are kept."""
        with torch.no_grad():
            if self._waiting:
                self._prefill(self._waiting.popleft())
                return "prefill"
            if self._running:
                self._decode()
                return "decode"
        return None

    def _prefill(self, request):
        tier = self.tier
        tier._synchronize()
        request.started = self.clock()
        cache = self._new_cache()
        try:
            inputs = torch.tensor([request.prompt], dtype=torch.long, device=tier.device)
            logits = tier.model(input_ids=inputs, **{tier._cache_name: cache}, use_cache=True, logits_to_keep=1).logits
            request.tokens.append(int(logits[:, -1].argmax(-1)))
        except Exception as error:
            request.error = _one_line(error)
            raise
        tier._synchronize()
        request.first = request.last = self.clock()
        if len(request.tokens) == request.max_new_tokens:
            self._finish(request)
        else:
            request.cache = cache
            self._running.append(request)

    def _decode(self):
        tier = self.tier
        joining = self._running[len(self._batch):self.max_batch]
        if joining:
            self._join(joining)
        batch = self._batch
        kwargs = {tier._cache_name: self._cache, "use_cache": True}
        if self.batchable:
            # Row i holds its length_i tokens right-aligned in _width columns; the new token is column _width.
            lengths = torch.tensor([r.length for r in batch], dtype=torch.long, device=tier.device)
            columns = torch.arange(self._width + 1, device=tier.device)
            kwargs["attention_mask"] = (columns[None] >= (self._width - lengths)[:, None]).long()
            kwargs["position_ids"] = lengths[:, None]
        try:
            inputs = torch.tensor([[r.tokens[-1]] for r in batch], dtype=torch.long, device=tier.device)
            logits = tier.model(input_ids=inputs, **kwargs).logits
            tokens = logits[:, -1].argmax(-1).tolist()
        except Exception as error:
            self._drop_batch(_one_line(error))
            raise
        tier._synchronize()
        now = self.clock()
        self._width += 1
        self.decode_steps += 1
        self.decoded_rows += len(batch)
        for request, token in zip(batch, tokens):
            request.tokens.append(token)
            request.last = now
        keep = [i for i, r in enumerate(batch) if len(r.tokens) < r.max_new_tokens]
        if len(keep) < len(batch):
            self._leave(keep)

    def _join(self, joining):
        """Adds the rows of `joining` (each with its own cache) to the batch's cache, left-padded."""
        if not self._batch and len(joining) == 1:  # nothing to pad: its own cache becomes the batch's
            self._cache, self._width = joining[0].cache, joining[0].length
        else:
            parts = ([(_layers(self._cache), self._width)] if self._batch else []) + \
                    [(_layers(r.cache), r.length) for r in joining]
            width = max(length for _, length in parts)
            cache = self._new_cache()
            for index in range(len(parts[0][0])):
                keys = torch.cat([_left_pad(layers[index][0], width - length) for layers, length in parts])
                values = torch.cat([_left_pad(layers[index][1], width - length) for layers, length in parts])
                cache.update(keys, values, index)
            self._cache, self._width = cache, width
        for request in joining:
            request.cache = None
        self._batch = self._batch + joining

    def _leave(self, keep):
        """Finishes the rows not in `keep` and keeps the others, without the columns now padding in every row."""
        for i, request in enumerate(self._batch):
            if i not in keep:
                self._running.remove(request)
                self._finish(request)
        self._batch = [self._batch[i] for i in keep]
        if not keep:
            self._cache, self._width = None, 0
            return
        width = max(r.length for r in self._batch)
        rows, first = torch.tensor(keep, device=self.tier.device), self._width - width
        cache = self._new_cache()
        for index, (keys, values) in enumerate(_layers(self._cache)):
            cache.update(keys[rows, :, first:], values[rows, :, first:], index)
        self._cache, self._width = cache, width

    def _drop_batch(self, error):
        for request in self._batch:
            request.error, request.cache = error, None
            self._running.remove(request)
        self._batch, self._cache, self._width = [], None, 0

    def _finish(self, request):
        later = len(request.tokens) - 1
        request.result = BatchedResult(list(request.tokens), request.first - request.arrival,
                                       (request.last - request.first) / later if later else 0.0,
                                       len(request.prompt), request.started - request.arrival)
        request.cache = None


def _layers(cache):
    """[(keys, values)] per layer of a DynamicCache ([rows, heads, length, head dim] each)."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def _left_pad(tensor, columns):
    if columns == 0:
        return tensor
    shape = list(tensor.shape)
    shape[-2] = columns
    return torch.cat([tensor.new_zeros(shape), tensor], dim=-2)


def _one_line(error):
    return f"{type(error).__name__}: {error}".replace("\n", " ")


def run_open_loop(batcher, arrivals, requests, deadline=None, give_up_s=30.0, sleep=time.sleep):
    """Serves requests[i] = (prompt_ids, max_new_tokens) arriving arrivals[i] seconds after the start
    (ascending), on the batcher's clock. Before each step, every request whose time has come is submitted
    with its scheduled arrival (so a late admission is not excused: no coordinated omission); with nothing
    to do it sleeps to the next arrival. Past `deadline` (a time of the clock) or once the oldest waiting
    request has waited over give_up_s (overloaded), it takes no more: the unprefilled are dropped, the
    running finish, and the run is marked incomplete.

    Returns {"offered": len(arrivals), "samples": [one dict per finished request, in arrival order],
    "complete": bool, "mean_batch": mean sequences per decode forward (0.0 without one)}."""
    clock = batcher.clock
    start = clock()
    steps, rows = batcher.decode_steps, batcher.decoded_rows
    schedule = collections.deque(zip(arrivals, requests))
    handles, complete = [], True
    while True:
        now = clock()
        while complete and schedule and start + schedule[0][0] <= now:
            at, (prompt, new_tokens) = schedule.popleft()
            handles.append((at, batcher.submit(prompt, new_tokens, arrival=start + at)))
        late = deadline is not None and now > deadline
        if complete and (schedule or batcher.waiting) and (late or batcher.oldest_wait(now) > give_up_s):
            complete = False
            schedule.clear()
            batcher.cancel_waiting()
        if batcher.step() is None:
            if not schedule:
                break
            sleep(max(0.0, start + schedule[0][0] - clock()))
    samples = [{"arrival_s": at, "wait_s": h.result.wait_s, "ttft_s": h.result.ttft_s, "prefill_s": h.first - h.started,
                "tpot_s": h.result.tpot_s, "tokens": len(h.result.tokens)} for at, h in handles if h.result]
    decodes = batcher.decode_steps - steps
    return {"offered": len(arrivals), "samples": samples, "complete": complete,
            "mean_batch": (batcher.decoded_rows - rows) / decodes if decodes else 0.0}
