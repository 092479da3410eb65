"""The family table kept in step with the pinned transformers: every model_type it ships with an MoE
block is packed (colibri.pack.families.FAMILIES, or WRAPPERS through its language model) or refused with
its reason (colibri.pack.refused), and README.md's table lists each with that status. A transformers that
adds an MoE model fails here until the model is mapped or refused. Needs transformers (skipped without)."""
import pathlib
import re

import pytest

transformers = pytest.importorskip("transformers")

from colibri import ColibriError  # noqa: E402
from colibri.pack.families import FAMILIES, WRAPPERS, _model_type, _plan  # noqa: E402
from colibri.pack.refused import REFUSED_FAMILIES  # noqa: E402
from colibri.testing import families as written  # noqa: E402

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
# The config fields an MoE model declares its expert count under, across transformers' models.
EXPERT_COUNTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
NOT_IN_TRANSFORMERS = {"kimi_k2"}  # refused by name though transformers has no such model_type
OVERRIDES = dict(top_k=None, routing=None, renormalize=None, routed_scaling_factor=None)


def declares_experts(config_class, seen=()) -> bool:
    """Whether a config class (or a sub-config class it builds) has an expert-count field."""
    names = set(getattr(config_class, "attribute_map", {}) or {})
    for base in config_class.__mro__:
        names |= set(getattr(base, "__annotations__", {})) | set(vars(base))
    if names & EXPERT_COUNTS:
        return True
    subs = (getattr(config_class, "sub_configs", None) or {}).values()
    return any(isinstance(sub, type) and sub not in seen and declares_experts(sub, seen + (config_class,))
               for sub in subs)


def moe_model_types() -> set:
    """The pinned transformers' model_types with an MoE block: their config (or a sub-config) declares an
    expert count, or their default text_config is such a model_type (sub-configs built through AutoConfig)."""
    from transformers import CONFIG_MAPPING
    found = {t for t in CONFIG_MAPPING.keys() if declares_experts(CONFIG_MAPPING[t])}
    for model_type in set(CONFIG_MAPPING.keys()) - found:
        try:
            text = getattr(CONFIG_MAPPING[model_type](), "text_config", None)
        except Exception:  # a config without usable defaults has no text_config to follow
            continue
        if getattr(text, "model_type", None) in found:
            found.add(model_type)
    return found


@pytest.fixture(scope="module")
def model_types():
    found = moe_model_types()
    assert {"mixtral", "deepseek_v3", "qwen3_5_moe", "llama4_text"} <= found  # the scan itself works
    return found


def readme_rows() -> dict:
    """model_type -> the rest of its row (its status cell starts with packed: or refused:), from README.md's
    family tables."""
    section = README.read_text().split("## Supported model families", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `([^`]+)` \|(.*)\|$", line)
        if match and match[1] != "model_type":  # not a header
            rows[match[1]] = match[2]
    return rows


def test_every_moe_model_type_is_packed_or_refused(model_types):
    unknown = sorted(model_types - set(FAMILIES) - set(WRAPPERS) - set(REFUSED_FAMILIES))
    version = transformers.__version__
    assert not unknown, f"transformers {version}'s MoE model_types neither packed nor refused: {unknown}"
    stale = sorted((set(FAMILIES) | set(WRAPPERS) | set(REFUSED_FAMILIES)) - model_types - NOT_IN_TRANSFORMERS)
    assert not stale, f"not an MoE model_type of transformers {version}: {stale}"
    assert not set(FAMILIES) & set(REFUSED_FAMILIES)


def test_every_packed_family_has_a_tiny_model_the_tests_check():
    assert set(FAMILIES) <= set(written.FAMILIES)
    for family, wrapper in written.WRAPPERS.items():  # each written as that multimodal model
        assert WRAPPERS[wrapper] == family
    assert set(WRAPPERS) == set(written.WRAPPERS.values())


def test_the_readme_table_lists_every_moe_model_type_with_its_status(model_types):
    rows = readme_rows()
    missing = sorted(model_types - set(rows))
    assert not missing, f"README.md's family table lacks {missing}"
    for model_type, row in rows.items():
        assert model_type in model_types | NOT_IN_TRANSFORMERS, f"README.md lists {model_type}, no MoE model_type"
        statuses = {cell.strip().split(":")[0] for cell in row.split("|")} & {"packed", "refused"}
        assert statuses == {"packed" if model_type in FAMILIES or model_type in WRAPPERS else "refused"}, row


@pytest.mark.parametrize("model_type", sorted(REFUSED_FAMILIES))
def test_a_refused_model_type_is_refused_with_its_reason(model_type):
    with pytest.raises(ColibriError) as refused:
        _plan({"model_type": model_type, "num_experts_per_tok": 2}, OVERRIDES, False)
    assert str(refused.value).endswith(f"model_type {model_type!r}: {REFUSED_FAMILIES[model_type]}")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_a_multimodal_model_packs_its_language_models_family(wrapper):
    hf = {"model_type": wrapper, "text_config": {"model_type": WRAPPERS[wrapper], "num_experts_per_tok": 3}}
    model_type, settings = _model_type(hf)
    assert model_type == WRAPPERS[wrapper] and settings["num_experts_per_tok"] == 3
    assert _plan(hf, OVERRIDES, False).family == WRAPPERS[wrapper]
