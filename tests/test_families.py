"""Every MoE family pack knows, checked against the family's own transformers code: a tiny random model
is written by transformers itself (colibri.testing.families) with every MoE option of the family
switched on, packed (every MoE layer, with --verify), and each packed layer is compared on random
tokens with the model's own MoE block in fp32: (a) colibri.reference, (b) colibri's CPU layer, once the
library has colibri_moe_context_create. Tokens at a routing near-tie are left out (fp32 may choose
either side). Needs torch and transformers (skipped without them)."""
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri import checkpoint, reference  # noqa: E402
from colibri.pack import block_forward, pack, routing_ties  # noqa: E402
from colibri.testing import relative_error  # noqa: E402
from colibri.testing.families import FAMILIES, GPT_OSS_SWIGLU, H, moe_blocks, write_model  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """family -> (its model, the folder of packed layers, the configs pack returned), made once."""
    cache = {}

    def make(family):
        if family not in cache:
            src = tmp_path_factory.mktemp(family)
            model = write_model(family, src)
            out = tmp_path_factory.mktemp(f"{family}_packed")
            configs = pack(src, out / "layers", layer="all", verify=True, progress=False)
            cache[family] = (model, out / "layers", configs)
        return cache[family]
    return make


def compare(family, written, forward):
    model, folder, configs = written(family)
    blocks = moe_blocks(model)
    assert len(configs) == len(blocks) and sorted(p.name for p in folder.iterdir()) == \
        sorted(f"layer{i}.colibri.safetensors" for i in blocks)
    errors = []
    for index, block in blocks.items():
        path = folder / f"layer{index}.colibri.safetensors"
        x = np.random.default_rng(index).standard_normal((48, H)).astype(np.float32)
        keep = ~routing_ties(path, x)
        assert keep.sum() >= 40, "too many routing near-ties to compare"
        expected = block_forward(block, x)[keep]
        errors.append(relative_error(forward(path, x)[keep], expected))
    return max(errors)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_config(family, written):
    _, expected = FAMILIES[family]
    _, folder, configs = written(family)
    for config in configs:
        for field, value in expected.items():
            assert getattr(config, field) == value, field
        assert config.weight_dtype == "fp32" and config.hidden_size == H
    assert checkpoint.load(next(folder.iterdir())).metadata["source_family"] == family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reference_matches_transformers(family, written):
    error = compare(family, written,
                    lambda path, x: reference.checkpoint_forward(checkpoint.load(path), x.astype(np.float64)))
    assert error < 1e-5, f"{family}: reference vs transformers relative error {error:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_colibri_cpu_matches_transformers(family, written):
    from colibri import MoELayer
    error = compare(family, written, lambda path, x: np.asarray(MoELayer.from_file(path).forward(x), np.float64))
    assert error < 1e-5, f"{family}: colibri CPU vs transformers relative error {error:.3g}"


def test_cohere2_moe_sigmoid_selection(tmp_path):
    """Cohere2-MoE's other expert_selection_fn: top-k on the logits, their sigmoids renormalised (the
    family's tiny model above selects with softmax); packed and checked against its block by --verify."""
    write_model("cohere2_moe", tmp_path / "src", expert_selection_fn="sigmoid", norm_topk_prob=True)
    configs = pack(tmp_path / "src", tmp_path / "layers", layer="all", verify=True, progress=False)
    assert [(c.routing, c.renormalize) for c in configs] == [("sigmoid_bias", True)] * 2


def test_verify_refuses_a_wrong_packing(written, tmp_path, monkeypatch):
    """--verify catches a layer that differs from the model: here routing renormalised against the
    config (an override), so the packed file is deleted."""
    from colibri import ColibriError
    model, _, _ = written("qwen3_moe")
    src = tmp_path / "src"
    model.save_pretrained(src)
    out = tmp_path / "x.colibri.safetensors"
    with pytest.raises(ColibriError, match="differs from transformers' Qwen3MoeSparseMoeBlock"):
        pack(src, out, renormalize=True, unverified_routing=True, verify=True, progress=False)
    assert not out.exists()


def test_verify_leaves_no_transformers_warning(tmp_path, colibri_cli):
    """--verify builds the family's MoE block on its own and names its experts implementation
    (eager), as a whole model would have: without it transformers warned on every verify that
    `config._experts_implementation` is None."""
    write_model("mixtral", tmp_path / "src")
    result = colibri_cli("pack", tmp_path / "src", "--out", tmp_path / "x.colibri.safetensors", "--verify", "--quiet")
    assert result.returncode == 0 and "verified against transformers" in result.stdout, result.stderr
    assert "ExpertsInterface" not in result.stderr, result.stderr


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_a_dense_model_saved_by_transformers_is_refused_at_once(model_type, tmp_path, colibri_cli):
    """A dense model as transformers writes it: one try, one line saying it has no MoE layer."""
    import transformers
    config = transformers.AutoConfig.for_model(model_type, hidden_size=H, intermediate_size=40, num_attention_heads=4,
                                               num_key_value_heads=2, vocab_size=64, num_hidden_layers=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "src")
    result = colibri_cli("pack", tmp_path / "src", "--out", tmp_path / "x.colibri.safetensors")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert f"no MoE layer found: a dense model (model_type '{model_type}'; none of its" in result.stderr


def test_gpt_oss_clamps_bite(written):
    """The gpt-oss comparisons above exercise the clamped SwiGLU at the released limit: on their tokens a good
    share of the routed experts' gate values pass the limit (clamped above), and of the up values +-limit."""
    model, _, configs = written("gpt_oss")
    limit = configs[0].activation_limit
    for index, block in moe_blocks(model).items():
        x = np.random.default_rng(index).standard_normal((48, H))
        router = block.router.weight.detach().double().numpy(), block.router.bias.detach().double().numpy()
        ids = np.argsort(-(x @ router[0].T + router[1]), axis=1)[:, :configs[0].top_k]  # the top-k experts
        gate_up = block.experts.gate_up_proj.detach().double().numpy()[ids]  # [T, k, H, 2F], interleaved
        h = np.einsum("th,tkhf->tkf", x, gate_up) + block.experts.gate_up_proj_bias.detach().double().numpy()[ids]
        gate, up = h[..., 0::2], h[..., 1::2]
        assert (gate > limit).mean() > 0.05 and (np.abs(up) > limit).mean() > 0.05, f"layer {index}"


def fixed_swiglu(monkeypatch):
    """transformers' GptOssExperts made to compute as the releases before 5.19 do: 1.702 and 7.0 whatever
    config.json says."""
    from transformers.models.gpt_oss import modeling_gpt_oss
    experts = modeling_gpt_oss.GptOssExperts
    original = experts.__init__

    def init(self, config):
        original(self, config)
        self.alpha, self.limit = 1.702, 7.0
    monkeypatch.setattr(experts, "__init__", init)


def test_gpt_oss_swiglu_from_config(tmp_path):
    """A clamped SwiGLU other than the released one: pack takes swiglu_alpha and swiglu_limit from config.json,
    and --verify checks the layer against a transformers that reads them too (5.19 on) or, where transformers
    fixes the released values, refuses naming why rather than blame the packed layer."""
    import transformers
    from packaging.version import Version

    from colibri import ColibriError
    write_model("gpt_oss", tmp_path / "src", **GPT_OSS_SWIGLU)
    config = pack(tmp_path / "src", tmp_path / "a.colibri.safetensors", progress=False)
    assert (config.activation_alpha, config.activation_limit) == (1.3, 5.0)
    out = tmp_path / "b.colibri.safetensors"
    if Version(transformers.__version__) >= Version("5.19"):
        assert pack(tmp_path / "src", out, verify=True, progress=False).activation_limit == 5.0
    else:
        with pytest.raises(ColibriError, match=r"GptOssExperts computes with swiglu_alpha 1.702 and swiglu_limit 7 "
                                               r"whatever config.json says \(here 1.3 and 5\)"):
            pack(tmp_path / "src", out, verify=True, progress=False)
        assert not out.exists()


def test_verify_refuses_a_transformers_with_fixed_swiglu(written, tmp_path, monkeypatch):
    """With GptOssExperts fixed at the released 1.702 and 7.0 (transformers before 5.19), --verify still checks
    a layer of the released values and refuses, in one line and keeping no file, one of other values."""
    import transformers

    from colibri import ColibriError
    fixed_swiglu(monkeypatch)
    model, _, _ = written("gpt_oss")
    model.save_pretrained(tmp_path / "released")
    assert pack(tmp_path / "released", tmp_path / "a.colibri.safetensors", verify=True, progress=False)
    write_model("gpt_oss", tmp_path / "other", **GPT_OSS_SWIGLU)
    out = tmp_path / "b.colibri.safetensors"
    with pytest.raises(ColibriError) as refused:
        pack(tmp_path / "other", out, verify=True, progress=False)
    assert str(refused.value).endswith(
        f"--verify: transformers {transformers.__version__}'s GptOssExperts computes with swiglu_alpha 1.702 and "
        "swiglu_limit 7 whatever config.json says (here 1.3 and 5), so it cannot check this layer; transformers "
        "5.19 and later read both")
    assert "\n" not in str(refused.value) and not out.exists()
