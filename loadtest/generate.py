"""The `generate` workload's parts that need no Locust (loadtest/locustfile.py's GenerateUser drives them;
the tests use them directly): the attention tier a process builds, open-loop arrival schedules, and a
request's sample.

A request is a prompt of random token ids through every layer of a model to its first new token, then
more tokens, run by an attention tier in the load-generating process. The tier is whatever a factory
returns: an object with `.generate(prompt_ids, max_new_tokens)` giving a result with .tokens, .ttft_s,
.tpot_s and .prompt_tokens (colibri.attention's AttentionTier, or anything with that interface).
The factory is named "module:function" (LOADTEST_TIER; the module importable from the locustfile's
folder or PYTHONPATH) and called as function(protocol, options), options being Locust's parsed options
(tier_model, tier_device, grpc_url, weights, model, ... as the locustfile defines them). Without one,
default_tier builds AttentionTier.from_pretrained from --tier-model, and "fake" builds FakeTier.

Time to first token, as a user feels it, runs from the request's arrival: with open-loop arrivals that
is its scheduled time, so a request that waited behind a busy tier counts its wait (no coordinated
omission); with closed-loop users it is when the user sent it.
"""
import importlib
import math
import random
import time
from dataclasses import dataclass, field

PROTOCOLS = ("inprocess", "grpc", "cudashm", "eager", "fake")


def poisson_arrivals(rate: float, rng: random.Random, start: float = 0.0):
    """Endless arrival times of a Poisson process of `rate` per second from `start`: independent
    exponential gaps, drawn ahead of any answer (open loop: the server's speed cannot slow the arrivals)."""
    if not rate > 0 or math.isinf(rate):
        raise ValueError(f"arrival rate {rate}: expected requests per second, > 0")
    t = start
    while True:
        t += rng.expovariate(rate)
        yield t


def prompt_ids(rng: random.Random, length: int, vocab: int) -> list:
    """A prompt of `length` token ids drawn uniformly from [0, vocab)."""
    return [rng.randrange(vocab) for _ in range(length)]


def vocab_size(tier, given: int = 0) -> int:
    """The vocabulary prompts are drawn from: `given` (--vocab-size), else the tier's vocab_size or its
    model's config.vocab_size."""
    if given > 0:
        return given
    for candidate in (getattr(tier, "vocab_size", None),
                      getattr(getattr(getattr(tier, "model", None), "config", None), "vocab_size", None)):
        if isinstance(candidate, int) and candidate > 0:
            return candidate
    raise ValueError(f"{type(tier).__name__} has no vocab_size (nor .model.config.vocab_size): give --vocab-size")


@dataclass
class Sample:
    """One generate request, as summary.py reads it: arrival (s, epoch) and end, TTFT from arrival to
    the first new token (the wait for the tier included), mean TPOT of the later tokens."""
    arrival: float
    end: float
    prompt_tokens: int
    ttft_ms: float = float("nan")
    tpot_ms: float = float("nan")
    new_tokens: int = 0
    error: str = ""
    tokens: list = field(default_factory=list, repr=False)


class WrongAnswer(Exception):
    """A generate result without the tokens asked for."""


def serve(tier, arrival: float, prompt: list, max_new_tokens: int, clock=time.time) -> Sample:
    """Runs one request on `tier` now (the caller holds the tier) and returns its sample. TTFT is the wait
    since `arrival` plus the tier's own prefill to the first token; an exception is the request's error."""
    start = clock()
    try:
        result = tier.generate(prompt, max_new_tokens)
        new = list(result.tokens)
        if not 1 <= len(new) <= max_new_tokens:
            raise WrongAnswer(f"{len(new)} new tokens, expected 1 to {max_new_tokens}")
        if int(result.prompt_tokens) != len(prompt):
            raise WrongAnswer(f"prompt_tokens {result.prompt_tokens}, sent {len(prompt)}")
        return Sample(arrival=arrival, end=clock(), prompt_tokens=len(prompt),
                      ttft_ms=((start - arrival) + float(result.ttft_s)) * 1000.0,
                      tpot_ms=float(result.tpot_s) * 1000.0, new_tokens=len(new), tokens=new)
    except Exception as exc:  # the request's failure, reported, never raised into the load generator
        return Sample(arrival=arrival, end=clock(), prompt_tokens=len(prompt),
                      error=f"{type(exc).__name__}: {exc}"[:300])


# --- tiers ------------------------------------------------------------------------------------------

@dataclass
class FakeResult:
    tokens: list
    ttft_s: float
    tpot_s: float
    prompt_tokens: int


class FakeTier:
    """The load generator's own check: computes nothing, takes prefill_s_per_token per prompt token to
    the first token and tpot_s per later token (slept, so other greenlets of the process run meanwhile,
    as they do while a real tier waits on the expert tier; busy: spinning instead, holding the process
    as a tier computing on the CPU does), and answers token ids derived from the prompt."""
    vocab_size = 1000

    def __init__(self, prefill_s_per_token: float = 1e-5, tpot_s: float = 0.002, sleep=None, clock=time.perf_counter,
                 busy: bool = False):
        self.prefill_s_per_token, self.tpot = prefill_s_per_token, tpot_s
        self.sleep, self.clock = sleep or (spin if busy else time.sleep), clock
        self.calls = 0

    def generate(self, prompt_ids, max_new_tokens: int) -> FakeResult:
        if not prompt_ids or max_new_tokens < 1:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens, max_new_tokens {max_new_tokens}")
        self.calls += 1
        start = self.clock()
        self.sleep(self.prefill_s_per_token * len(prompt_ids))
        first = self.clock()
        self.sleep(self.tpot * (max_new_tokens - 1))
        end = self.clock()
        seed = sum(prompt_ids) % self.vocab_size
        return FakeResult(tokens=[(seed + i) % self.vocab_size for i in range(max_new_tokens)],
                          ttft_s=first - start, tpot_s=(end - first) / (max_new_tokens - 1) if max_new_tokens > 1 else 0.0,
                          prompt_tokens=len(prompt_ids))


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def fake_tier(protocol, options):
    """FakeTier with the service times of LOADTEST_FAKE_PREFILL_S_PER_TOKEN and LOADTEST_FAKE_TPOT_S
    (tests set them), sleeping through gevent when Locust has patched time.sleep, or spinning with
    LOADTEST_FAKE_BUSY=1, after LOADTEST_FAKE_BUILD_S seconds of spinning (a slow build)."""
    import os
    spin(float(os.environ.get("LOADTEST_FAKE_BUILD_S", "0")))
    return FakeTier(float(os.environ.get("LOADTEST_FAKE_PREFILL_S_PER_TOKEN", "1e-5")),
                    float(os.environ.get("LOADTEST_FAKE_TPOT_S", "0.002")),
                    busy=os.environ.get("LOADTEST_FAKE_BUSY") == "1")


def default_tier(protocol, options):
    """AttentionTier.from_pretrained(--tier-model) with expert_tier(protocol) (colibri.attention), or for
    "eager" the model's own transformers MoE blocks (AttentionTier.eager), on --tier-device, in
    --tier-dtype when given (give it for a like-for-like comparison of protocols and eager)."""
    if not getattr(options, "tier_model", ""):
        raise ValueError("the generate workload needs --tier-model HF_DIR (LOADTEST_TIER_MODEL), or a tier "
                         "factory in LOADTEST_TIER=module:function")
    import torch
    device = options.tier_device
    dtype = getattr(torch, options.tier_dtype, None) if getattr(options, "tier_dtype", "") else None
    if getattr(options, "tier_dtype", "") and not isinstance(dtype, torch.dtype):
        raise ValueError(f"--tier-dtype {options.tier_dtype!r}: not a torch dtype (bfloat16, float16, float32)")
    from colibri.attention import AttentionTier, expert_tier
    if protocol == "eager":
        import transformers
        model = transformers.AutoModelForCausalLM.from_pretrained(
            options.tier_model, **({"dtype": dtype} if dtype is not None else {}))
        return AttentionTier.eager(model.to(device).eval())
    experts = expert_tier(protocol, url=options.grpc_url or None, weights=options.weights or None, device=device,
                          model=options.model)
    return AttentionTier.from_pretrained(options.tier_model, experts, device=device, dtype=dtype)


def load_factory(spec: str):
    """The tier factory named by "module:function" ("" or "default": default_tier; "fake": fake_tier)."""
    if spec in ("", "default"):
        return default_tier
    if spec == "fake":
        return fake_tier
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"LOADTEST_TIER={spec!r}: expected module:function")
    factory = getattr(importlib.import_module(module), name, None)
    if not callable(factory):
        raise ValueError(f"LOADTEST_TIER={spec!r}: {module} has no function {name}")
    return factory
