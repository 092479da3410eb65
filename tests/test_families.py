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
from colibri._native import HAS_CONTEXT_CREATE  # noqa: E402
from colibri.pack import block_forward, pack, routing_ties  # noqa: E402
from colibri.testing import relative_error  # noqa: E402
from colibri.testing.families import FAMILIES, H, moe_blocks, write_model  # noqa: E402


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


@pytest.mark.skipif(not HAS_CONTEXT_CREATE, reason="this libcolibri predates colibri_moe_context_create")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_colibri_cpu_matches_transformers(family, written):
    from colibri import MoELayer
    error = compare(family, written, lambda path, x: np.asarray(MoELayer.from_file(path).forward(x), np.float64))
    assert error < 1e-5, f"{family}: colibri CPU vs transformers relative error {error:.3g}"


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
