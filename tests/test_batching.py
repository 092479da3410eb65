"""Continuous batching over the attention tier (colibri.attention.batching) on the CPU, with the tiny
models of test_generate (colibri.testing.generation, made once per session by conftest's generate_models):
requests joining and leaving the running batch mid-run, rows of different lengths decoded together,
each request's tokens exactly those of AttentionTier.generate for its prompt alone and of transformers'
own greedy generate; gpt-oss (a sliding-window cache layer) through the batch-1 path; the eager
baseline through the batcher; one-line refusals and a failed forward that the batcher survives; and
the open-loop driver on a fake clock, where TTFT counts from each request's arrival. Needs torch and
transformers (skipped without)."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri.attention import AttentionTier, ContinuousBatcher, expert_tier, run_open_loop  # noqa: E402

# (prompt index, max_new_tokens, steps run after its submit): submits interleaved with steps, so requests
# join a running batch, leave it at different times, and (with max_batch 2) wait for a place in it.
PLAN = [(0, 16, 2), (1, 5, 3), (2, 12, 1), (0, 3, 4), (1, 9, 2), (2, 1, 0), (1, 7, 3)]


def serve_plan(batcher, family, plan=PLAN):
    """Runs the plan; returns [(prompt, max_new_tokens, Request)], the batch memberships seen after each
    step, and whether some decode forward held rows of different lengths."""
    handles, memberships, mixed = [], [], False

    def step():
        nonlocal mixed
        batcher.step()
        # the rows after a step were all in its decode forward (a sequence joins only inside one)
        memberships.append(tuple(r.number for r in batcher.batch))
        mixed |= len({r.length for r in batcher.batch}) > 1
    for index, new_tokens, steps in plan:
        prompt = family.prompts[index]
        handles.append((prompt, new_tokens, batcher.submit(prompt, new_tokens)))
        for _ in range(steps):
            step()
    while not batcher.idle:
        step()
    return handles, memberships, mixed


def assert_tokens(handles, family, tier):
    for prompt, new_tokens, handle in handles:
        assert handle.done and handle.error is None
        result = handle.result
        expected = family.expected[family.prompts.index(prompt)][:new_tokens]  # greedy: a prefix of 16
        assert result.tokens == expected, (family.name, prompt, new_tokens)
        assert result.tokens == tier.generate(prompt, new_tokens).tokens
        assert result.prompt_tokens == len(prompt) and 0 <= result.wait_s < result.ttft_s
        assert (result.tpot_s > 0) == (new_tokens > 1)


def changes(memberships):
    return sum(a != b for a, b in zip(memberships, memberships[1:]))


def test_requests_joining_and_leaving_get_their_own_tokens(family):
    tier = AttentionTier.from_pretrained(family.hf_dir, expert_tier("inprocess", weights=family.packed))
    batcher = ContinuousBatcher(tier, max_batch=2)
    handles, memberships, mixed = serve_plan(batcher, family)
    assert_tokens(handles, family, tier)
    if family.name == "gpt_oss":  # a sliding-window cache layer: one sequence per decode forward
        assert not batcher.batchable and batcher.max_batch == 1
        assert batcher.decoded_rows == batcher.decode_steps
    else:
        assert batcher.batchable and batcher.max_batch == 2
        assert max(map(len, memberships)) == 2 and changes(memberships) >= 3 and mixed
        assert batcher.decoded_rows > batcher.decode_steps
    assert batcher.decoded_rows == sum(n - 1 for _, n, _ in PLAN)
    tier.close()


def test_the_eager_baseline_through_the_batcher(family):
    """transformers' model with its own MoE blocks, batched (32 rows at most: every running sequence)."""
    tier = AttentionTier.eager(family.model)
    batcher = ContinuousBatcher(tier)
    handles, memberships, _ = serve_plan(batcher, family)
    assert_tokens(handles, family, tier)
    if family.name != "gpt_oss":
        assert max(map(len, memberships)) >= 3 and changes(memberships) >= 3


def refused(match, call, *args, **kwargs):
    with pytest.raises(colibri.ColibriError, match=match) as error:
        call(*args, **kwargs)
    assert "\n" not in str(error.value)


def test_bad_requests_are_refused_and_the_next_one_is_right(qwen):
    tier = AttentionTier.from_pretrained(qwen.hf_dir, expert_tier("inprocess", weights=qwen.packed))
    batcher = ContinuousBatcher(tier, max_batch=4)
    first = batcher.submit(qwen.prompts[0], 6)
    batcher.step()
    batcher.step()
    refused(r"^invalid argument: prompt_ids: 64 is outside the model's vocabulary \[0, 64\)$", batcher.submit, [1, 64], 2)
    refused(r"max_new_tokens: expected at least 1, got 0$", batcher.submit, [1, 2], 0)
    refused(r"max_new_tokens: expected at least 1, got x$", batcher.submit, [1, 2], "x")
    refused(r"prompt_ids: empty", batcher.submit, [], 2)
    refused(r"prompt_ids: expected a list of token ids \(integers\), got \[1, 'a'\]$", batcher.submit, [1, "a"], 2)
    refused(r"max_batch: expected at least 1, got 0$", ContinuousBatcher, tier, max_batch=0)
    assert batcher.waiting == 0 and batcher.running == 1
    second = batcher.submit(qwen.prompts[1], 8)
    while not batcher.idle:
        batcher.step()
    assert first.result.tokens == qwen.expected[0][:6] and second.result.tokens == qwen.expected[1][:8]


class FailingExperts:
    """The in-process expert tier, raising once when told to."""

    def __init__(self, experts):
        self.experts, self.layers, self.hidden_size, self.fail = experts, experts.layers, experts.hidden_size, False

    def forward(self, layer, hidden):
        if self.fail:
            self.fail = False
            raise RuntimeError("expert tier lost\nsecond line")
        return self.experts.forward(layer, hidden)

    def close(self):
        self.experts.close()


def test_a_failed_forward_fails_its_requests_and_the_batcher_goes_on(qwen):
    experts = FailingExperts(expert_tier("inprocess", weights=qwen.packed))
    tier = AttentionTier.from_pretrained(qwen.hf_dir, experts)
    batcher = ContinuousBatcher(tier, max_batch=2)
    a, b, c = (batcher.submit(qwen.prompts[i], 10) for i in range(3))
    for _ in range(4):  # three prefills and a decode of a and b; c waits for a place
        batcher.step()
    assert [r.number for r in batcher.batch] == [a.number, b.number]
    experts.fail = True
    with pytest.raises(RuntimeError, match="expert tier lost"):
        batcher.step()
    assert a.error == b.error == "RuntimeError: expert tier lost second line" and a.result is None
    assert batcher.running == 1 and not c.done
    d = batcher.submit(qwen.prompts[0], 4)
    while not batcher.idle:
        batcher.step()
    assert c.result.tokens == qwen.expected[2][:10] and d.result.tokens == qwen.expected[0][:4]


class FakeClock:
    """Seconds that pass only when the model runs (a prompt's prefill 1.0, a decode forward 0.25) or the
    driver sleeps."""

    def __init__(self, model):
        self.now = 0.0
        self.hook = model.register_forward_pre_hook(self.forward, with_kwargs=True)

    def forward(self, module, args, kwargs):
        self.now += 1.0 if kwargs["input_ids"].shape[1] > 1 else 0.25

    def __call__(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


@pytest.fixture
def fake(qwen):
    """A batcher over the eager baseline on a FakeClock (the family's prompts are 2-12 tokens: a
    forward of one token is a decode)."""
    tier = AttentionTier.eager(qwen.model)
    clock = FakeClock(tier.model)
    yield ContinuousBatcher(tier, clock=clock), clock
    clock.hook.remove()


def test_the_open_loop_driver_counts_ttft_from_arrival(fake, qwen):
    batcher, clock = fake
    requests = [(qwen.prompts[i % 3], 3) for i in range(4)]
    run = run_open_loop(batcher, [0.0, 0.5, 0.75, 5.0], requests, sleep=clock.sleep)
    # 0: prefill 0 (to 1.0); 1: prefill 1 (arrived 0.5, to 2.0); 2: prefill 2 (arrived 0.75, to 3.0);
    # decodes of 0, 1, 2 to 3.25 and 3.5, all done; idle, sleep to 5.0; prefill 3 to 6.0, decodes to 6.5.
    assert run["complete"] and run["offered"] == 4 and len(run["samples"]) == 4
    got = [s[key] for s in run["samples"] for key in ("arrival_s", "wait_s", "ttft_s", "prefill_s", "tpot_s", "tokens")]
    assert got == pytest.approx([0.0, 0.0, 1.0, 1.0, 1.25, 3, 0.5, 0.5, 1.5, 1.0, 0.75, 3,
                                 0.75, 1.25, 2.25, 1.0, 0.25, 3, 5.0, 0.0, 1.0, 1.0, 0.25, 3])
    assert run["mean_batch"] == pytest.approx(8 / 4) and clock.now == pytest.approx(6.5)


def test_the_open_loop_driver_gives_up_when_overloaded_or_late(fake, qwen):
    batcher, clock = fake
    requests = [(qwen.prompts[0], 2)] * 4
    # Prefill 0 to 1.0; 1, 2, 3 come in; prefill 1 to 2.0: 2 has waited 1.8 > 1.5, so 2 and 3 are dropped.
    run = run_open_loop(batcher, [0.0, 0.1, 0.2, 0.3], requests, give_up_s=1.5, sleep=clock.sleep)
    assert not run["complete"] and run["offered"] == 4 and [s["arrival_s"] for s in run["samples"]] == [0.0, 0.1]
    assert batcher.idle
    start = clock.now
    run = run_open_loop(batcher, [0.0, 1.0, 2.0], requests[:3], deadline=start + 0.5, sleep=clock.sleep)
    assert not run["complete"] and [s["ttft_s"] for s in run["samples"]] == pytest.approx([1.0])
