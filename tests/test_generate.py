"""The attention tier end to end on the CPU: tiny random fp32 models written by transformers'
save_pretrained (Qwen3-MoE of 4 layers, two of them MoE; DeepSeek-V3 with a dense first layer, grouped
sigmoid routing and a shared expert; gpt-oss, whose block returns a tuple), every MoE layer packed with
`pack --layer all --verify`, and greedy generation through colibri.attention, in-process and over gRPC
from the real tritonserver serving the packed folder (one server start per family), giving exactly the
tokens of transformers' own `generate` (16 new tokens, 3 random prompts per family, drawn again where
transformers' own top two logits, or some MoE layer's routing, are near a tie: colibri.testing.generation,
shared with test_batching through conftest's generate_models). Also: the tier reads no expert weight,
the CLI once end to end, and the one-line refusals. Needs torch and transformers (skipped without); the gRPC tests
need tritonserver (skipped without)."""
import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import colibri  # noqa: E402
from colibri import __main__ as cli  # noqa: E402
from colibri.attention import AttentionTier, ColibriBlock, expert_tier  # noqa: E402
from colibri.pack.source import _Source  # noqa: E402
from colibri.testing.families import write_model  # noqa: E402
from colibri.testing.generation import MOE_LAYERS, NEW_TOKENS  # noqa: E402
from colibri.testing.server import missing_reason, serving  # noqa: E402

needs_server = pytest.mark.skipif(missing_reason() is not None, reason=f"no tritonserver: {missing_reason()}")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """family -> a tritonserver serving its packed folder. One runs at a time (CI has 2 cores): asking for
    another family's stops it. The gRPC tests run one family after another, qwen3_moe last, and the CLI's
    (qwen3_moe) right after them, so each family's server starts once."""
    running = {}

    def server(family, dtype="fp32"):
        if missing_reason() is not None:
            pytest.skip(f"no tritonserver: {missing_reason()}")
        if (family.name, dtype) not in running:
            for context, _ in running.values():
                context.__exit__(None, None, None)
            running.clear()
            context = serving(family.packed, tmp_path_factory.mktemp("logs"), "--device", "cpu", "--dtype", dtype)
            running[family.name, dtype] = (context, context.__enter__())
        return running[family.name, dtype][1]
    yield server
    for context, _ in running.values():
        context.__exit__(None, None, None)


def assert_generates_reference(tier, family):
    for prompt, expected in zip(family.prompts, family.expected):
        result = tier.generate(prompt, NEW_TOKENS)
        assert result.tokens == expected, (family.name, prompt)
        assert result.prompt_tokens == len(prompt) and result.ttft_s > 0 and result.tpot_s > 0


def test_inprocess_generates_transformers_tokens_reading_no_expert_weight(family, monkeypatch):
    read = []
    original = _Source.get
    monkeypatch.setattr(_Source, "get", lambda self, name: read.append(name) or original(self, name))
    tier = AttentionTier.from_pretrained(family.hf_dir, expert_tier("inprocess", weights=family.packed))
    assert tier.moe_layers == MOE_LAYERS[family.name]
    moe_prefixes = tuple(f"model.layers.{n}.mlp." for n in MOE_LAYERS[family.name])
    assert read and not [n for n in read if n.startswith(moe_prefixes)], "an expert or router weight was read"
    # Every tensor transformers loads is there, the same, and the rotary buffers are computed as transformers does.
    ours, theirs = dict(tier.model.named_buffers()), dict(family.model.named_buffers())
    assert ours and all(torch.equal(ours[k], theirs[k]) for k in ours)
    reference = family.model.state_dict()
    state = tier.model.state_dict()
    assert set(state) == {k for k in reference if not k.startswith(moe_prefixes)}
    assert all(torch.equal(state[k], reference[k]) for k in state)
    assert_generates_reference(tier, family)
    tier.close()


@needs_server
def test_grpc_generates_transformers_tokens(family, servers):
    server = servers(family)
    experts = expert_tier("grpc", url=server.grpc_url)
    assert experts.layers == set(MOE_LAYERS[family.name]) and experts.datatype == "FP32"
    tier = AttentionTier.from_pretrained(family.hf_dir, experts)
    assert_generates_reference(tier, family)
    # A prompt longer than the model's max_batch_size goes as several requests, and means the same.
    experts.max_tokens = 3
    assert tier.generate(family.prompts[0], 2).tokens == family.expected[0][:2]
    tier.close()


@needs_server
def test_the_cli_writes_the_tokens_and_timings(qwen, servers, tmp_path, colibri_cli):
    family, out = qwen, tmp_path / "out.json"
    prompt = family.prompts[0]
    result = colibri_cli("generate", "--url", servers(family).grpc_url, "--model", family.hf_dir, "--prompt-ids",
                         ",".join(map(str, prompt)), "--max-new-tokens", NEW_TOKENS, "--warmup", 0, "--json", out)
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads(out.read_text())
    assert set(written) == {"tokens", "ttft_ms", "tpot_ms"} and written["tokens"] == family.expected[0]
    assert written["ttft_ms"] > 0 and written["tpot_ms"] > 0
    assert result.stdout.startswith(f"colibri generate: {NEW_TOKENS} tokens after {len(prompt)} prompt tokens")


class Bf16Wire:
    """The in-process layers as a server started with --dtype bf16 computes them: hidden states rounded to
    bf16, the layer run on bf16 activations, its bf16 output widened back."""

    def __init__(self, experts):
        self.experts, self.layers, self.hidden_size = experts, experts.layers, experts.hidden_size

    def forward(self, layer, hidden):
        return self.experts.forward(layer, hidden.to(torch.bfloat16)).to(hidden.dtype)

    def close(self):
        self.experts.close()


@needs_server
def test_bf16_on_the_wire_is_what_the_server_computes(qwen, servers):
    """A server of --dtype bf16: the gRPC tier sends tritonclient's BF16 arrays and reads them back, giving
    the tokens of the same layers computed in-process on bf16 activations."""
    experts = expert_tier("grpc", url=servers(qwen, "bf16").grpc_url)
    assert experts.datatype == "BF16"
    tier = AttentionTier.from_pretrained(qwen.hf_dir, experts)
    emulated = AttentionTier.from_pretrained(qwen.hf_dir, Bf16Wire(expert_tier("inprocess", weights=qwen.packed)))
    for prompt in qwen.prompts:
        assert tier.generate(prompt, NEW_TOKENS).tokens == emulated.generate(prompt, NEW_TOKENS).tokens, prompt
    tier.close()


def test_the_eager_baseline_and_the_drop_in_block(family, tmp_path):
    """AttentionTier.eager is transformers' model as it is; ColibriBlock put in place of each MoE block of
    a copy gives the family's block output (a tuple for gpt-oss) and the same tokens."""
    baseline = AttentionTier.eager(family.model)
    assert baseline.moe_layers == MOE_LAYERS[family.name]
    assert baseline.generate(family.prompts[0], NEW_TOKENS).tokens == family.expected[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir).eval()
    x = torch.randn(1, 5, model.config.hidden_size)
    for n in MOE_LAYERS[family.name]:
        own = model.model.layers[n].mlp
        block = ColibriBlock.from_file(family.packed / f"layer{n}.colibri.safetensors", family=family.name)
        with torch.no_grad():
            expected, got = own(x), block(x)
        assert type(got) is type(expected)
        if isinstance(expected, tuple):
            expected, got = expected[0], got[0]
        assert got.shape == expected.shape and got.dtype == torch.float32
        assert float((got - expected).norm() / expected.norm()) < 1e-5
        model.model.layers[n].mlp = block
    with torch.no_grad():
        ids = torch.tensor([family.prompts[1]])
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                                eos_token_id=None)[0, len(family.prompts[1]):].tolist()
    assert tokens == family.expected[1]


def test_a_model_already_built_is_wrapped(family):
    """AttentionTier(model, experts), as for random weights built on a GPU: its MoE blocks are replaced
    (their parameters gone with them) and it generates the same tokens."""
    model = transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir).eval()
    before = {name for name, _ in model.named_parameters()}
    tier = AttentionTier(model, expert_tier("inprocess", weights=family.packed))
    moe_prefixes = tuple(f"model.layers.{n}.mlp." for n in MOE_LAYERS[family.name])
    after = {name for name, _ in model.named_parameters()}
    assert after == {n for n in before if not n.startswith(moe_prefixes)} and after != before
    assert tier.moe_layers == MOE_LAYERS[family.name]
    assert tier.generate(family.prompts[2], NEW_TOKENS).tokens == family.expected[2]


def test_from_config_draws_the_non_expert_weights_as_transformers_does(family):
    """AttentionTier.from_config (figures of a released shape): no expert allocated, the rest drawn by
    transformers' own _init_weights (seeded: the same seed, the same model), the buffers transformers'."""
    config = family.model.config
    experts = expert_tier("inprocess", weights=family.packed)
    tier = AttentionTier.from_config(config, experts, seed=3)
    assert tier.moe_layers == MOE_LAYERS[family.name]
    moe_prefixes = tuple(f"model.layers.{n}.mlp." for n in MOE_LAYERS[family.name])
    params = dict(tier.model.named_parameters())
    assert set(params) == {n for n, _ in family.model.named_parameters() if not n.startswith(moe_prefixes)}
    std = config.initializer_range
    for name, value in params.items():
        assert torch.isfinite(value).all(), name
        if name.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), name
        elif value.dim() == 2:
            assert 0.7 * std < float(value.detach().std()) < 1.3 * std, name
    theirs = dict(family.model.named_buffers())
    assert all(torch.equal(theirs[name], value) for name, value in tier.model.named_buffers())
    again = AttentionTier.from_config(config, experts, seed=3)
    assert all(torch.equal(params[n], p) for n, p in again.model.named_parameters())
    tokens = tier.generate(family.prompts[0], 4).tokens
    assert again.generate(family.prompts[0], 4).tokens == tokens
    other = dict(AttentionTier.from_config(config, experts, seed=4).model.named_parameters())
    assert not torch.equal(other["model.embed_tokens.weight"], params["model.embed_tokens.weight"])


# ---- refusals, in one line ------------------------------------------------------------------------


def refused(match, call, *args, **kwargs):
    with pytest.raises(colibri.ColibriError, match=match) as error:
        call(*args, **kwargs)
    assert "\n" not in str(error.value)


def test_the_tier_refuses_what_it_cannot_run(qwen, tmp_path):
    import shutil
    family = qwen
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(family.packed / "layer1.colibri.safetensors", partial)
    refused(r"serves layers 1, the model's MoE layers are 1, 3: missing 3 \(pack --layer all",
            AttentionTier.from_pretrained, family.hf_dir, expert_tier("inprocess", weights=partial))
    shutil.copy(family.packed / "layer1.colibri.safetensors", partial / "layer5.colibri.safetensors")
    shutil.copy(family.packed / "layer3.colibri.safetensors", partial)
    refused(r"serves layers 1, 3, 5, .*: 5 not MoE layers of this model",
            AttentionTier.from_pretrained, family.hf_dir, expert_tier("inprocess", weights=partial))
    built = transformers.AutoModelForCausalLM.from_pretrained(family.hf_dir).eval()
    refused(r"serves layers 1, 3, 5, .*: 5 not MoE layers", AttentionTier, built,
            expert_tier("inprocess", weights=partial))
    assert type(built.model.layers[1].mlp).__name__ == "Qwen3MoeSparseMoeBlock", "refused, yet changed"
    refused(r"weights .*layer1.colibri.safetensors: one layer file; the expert tier needs a folder",
            expert_tier, "inprocess", weights=family.packed / "layer1.colibri.safetensors")
    tier = AttentionTier.from_pretrained(family.hf_dir, expert_tier("inprocess", weights=family.packed))
    refused(r"prompt_ids: 64 is outside the model's vocabulary \[0, 64\)$", tier.generate, [1, 64], 2)
    refused(r"prompt_ids: empty", tier.generate, [], 2)
    refused(r"max_new_tokens: expected at least 1, got 0", tier.generate, [1], 0)
    refused(r"url 127.0.0.1:1: no Triton server answers there", expert_tier, "grpc", url="127.0.0.1:1")
    refused(r"url 'http://127.0.0.1:8001': expected HOST:PORT", expert_tier, "grpc", url="http://127.0.0.1:8001")
    refused(r"protocol: expected one of inprocess, grpc, cudashm, got 'http'", expert_tier, "http", url="x:1")
    if not torch.cuda.is_available():
        refused(r"^invalid argument: cudashm needs ", expert_tier, "cudashm", url="127.0.0.1:1", device="cuda")


def test_a_missing_non_expert_weight_or_a_dense_model_is_refused(qwen, tmp_path):
    from safetensors.torch import load_file, save_file
    family = qwen
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((family.hf_dir / "config.json").read_text())
    tensors = load_file(family.hf_dir / "model.safetensors")
    del tensors["model.layers.2.self_attn.q_proj.weight"]
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    experts = expert_tier("inprocess", weights=family.packed)
    refused(r"1 non-expert weight\(s\) missing from its safetensors: model.layers.2.self_attn.q_proj.weight$",
            AttentionTier.from_pretrained, damaged, experts)
    dense = tmp_path / "dense"
    write_model("qwen3_moe", dense, num_hidden_layers=2, mlp_only_layers=[0, 1])
    refused(r"qwen3_moe model of 2 layers has no MoE block \(Qwen3MoeSparseMoeBlock\)",
            AttentionTier.from_pretrained, dense, experts)
    llama = tmp_path / "llama"
    transformers.AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4, num_hidden_layers=1,
                                      intermediate_size=16, vocab_size=64).save_pretrained(llama)
    refused(r"model_type 'llama' is not an MoE family the attention tier knows",
            AttentionTier.from_pretrained, llama, experts)


def test_the_cli_refuses_in_one_line(qwen, tmp_path, capsys, monkeypatch):
    family = qwen
    monkeypatch.setattr(sys, "argv", ["python -m colibri"])
    base = ["generate", "--model", str(family.hf_dir), "--max-new-tokens", "2", "--json", str(tmp_path / "o.json")]
    cases = [(["--prompt-ids", "1,2", "--url", "127.0.0.1:1"], 1, "url 127.0.0.1:1: no Triton server answers"),
             (["--prompt-ids", "1,99", "--protocol", "inprocess", "--weights", str(family.packed)], 1,
              "prompt_ids: 99 is outside the model's vocabulary [0, 64)"),
             (["--prompt-ids", "1,2", "--protocol", "inprocess"], 2, "--protocol inprocess needs --weights"),
             (["--prompt-ids", "1,2"], 2, "--protocol grpc needs --url HOST:PORT"),
             (["--prompt-ids", "1,2", "--protocol", "cudashm", "--url", "127.0.0.1:1"], 2,
              "--protocol cudashm needs --device cuda")]
    for extra, code, message in cases:
        assert cli.main(base + extra) == code, extra
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o.json").exists()


def test_without_torch_generate_says_what_it_needs_in_one_line(tmp_path):
    """torch blocked (as on a host without the attention extra): one line naming the extra, exit 2."""
    code = ("import sys\nclass NoTorch:\n    @staticmethod\n    def find_spec(name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'transformers'):\n"
            "            raise ImportError(f'no module named {name!r}')\n"
            "sys.meta_path.insert(0, NoTorch())\nfrom colibri import __main__ as cli\n"
            f"sys.exit(cli.main(['generate', '--url', '127.0.0.1:1', '--model', {str(tmp_path)!r}, '--prompt-ids', "
            f"'1', '--max-new-tokens', '1', '--json', {str(tmp_path / 'o.json')!r}]))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("colibri generate: needs torch and transformers (pip install "
                                    "'colibri-moe[attention]')"), result.stderr


def test_generate_help_runs_without_loading_torch():
    """`generate --help` answers before torch or transformers is imported (a user without them learns how)."""
    code = ("import sys\nfrom colibri import __main__ as cli\ntry:\n    cli.main(['generate', '--help'])\n"
            "except SystemExit:\n    pass\nprint('torch' in sys.modules, 'transformers' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip().endswith("False False"), result.stdout + result.stderr
