"""The served checkpoint's identity (colibri.serving.identity): path, size, modification time, a sha256 of the
whole file kept beside it while the file is unchanged, demo or not; written by the launchers into the
config.pbtxt Triton reads (colibri.serving.triton_config.stage_repository) and logged by model.py. That a real
tritonserver shows it in GET .../config is checked in test_serving.py."""
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from colibri import checkpoint
from colibri.serving import identity, triton_config
from colibri.config import LayerConfig
from colibri.testing import fake_backend
from colibri.testing.server import REPO_ROOT

MODEL = "colibri_moe"


@pytest.fixture
def demo(tmp_path):
    path = tmp_path / "demo.colibri.safetensors"
    checkpoint.write_demo(path, experts=4, top_k=2, hidden=32, intermediate=48, seed=5)
    return path


def packed(path, source):
    """A checkpoint that is not a demo: what pack writes, with its metadata "source"."""
    config = LayerConfig(num_experts=2, top_k=1, hidden_size=8, intermediate_size=8, expert_kind="linear",
                         weight_dtype="fp32", routing="softmax_topk", renormalize=False, has_router=False)
    checkpoint.save(path, config, np.full((2, 64), 0.5, np.float32), extra_metadata={"source": source})
    return path


def test_identity_names_the_file_its_hash_and_whether_it_is_a_demo(demo, tmp_path):
    ident = identity.of(demo)
    stat = demo.stat()
    assert (ident.path, ident.size, ident.mtime_ns) == (str(demo), stat.st_size, stat.st_mtime_ns)
    assert ident.sha256 == hashlib.sha256(demo.read_bytes()).hexdigest()
    assert ident.demo and ident.source == "colibri demo (seed 5)"
    assert "DEMO checkpoint (random weights)" in ident.describe() and ident.sha256 in ident.describe()
    real = identity.of(packed(tmp_path / "real.colibri.safetensors", "/models/Mixtral-8x7B"))
    assert not real.demo and real.describe().endswith("packed from /models/Mixtral-8x7B")


def test_sha256_is_kept_beside_the_file_while_it_is_unchanged(demo, monkeypatch):
    first = identity.of(demo)
    kept = identity.cache_path(demo)
    # sha256sum's own format: the digest can be checked without colibri.
    check = subprocess.run(["sha256sum", "-c", os.path.basename(kept)], cwd=demo.parent, capture_output=True, text=True)
    assert check.returncode == 0 and check.stdout.strip() == f"{demo.name}: OK", check.stdout + check.stderr

    def no_hashing(path):
        raise AssertionError("hashed again although the file is unchanged")
    monkeypatch.setattr(identity, "_sha256", no_hashing)
    assert identity.of(demo).sha256 == first.sha256
    monkeypatch.undo()
    # Rewritten (another seed, same size): a new digest, whatever the old record says.
    checkpoint.write_demo(demo, experts=4, top_k=2, hidden=32, intermediate=48, seed=6)
    os.utime(demo, ns=(first.mtime_ns + 1, first.mtime_ns + 1))
    assert identity.of(demo).sha256 == hashlib.sha256(demo.read_bytes()).hexdigest() != first.sha256


def test_where_the_hash_cannot_be_kept_each_start_hashes_and_says_so(demo, monkeypatch, tmp_path):
    monkeypatch.setattr(identity, "NOTABLE_SECONDS", 0.0)
    # As a read-only folder would (this suite may run as root, whom permissions do not stop).
    unwritable = tmp_path / "missing" / "demo.sha256"
    monkeypatch.setattr(identity, "cache_path", lambda path: str(unwritable))
    first, second = identity.of(demo), identity.of(demo)
    assert first.sha256 == second.sha256 == hashlib.sha256(demo.read_bytes()).hexdigest()
    assert second.note.startswith(f"sha256 of {demo} ({demo.stat().st_size} bytes) took ")
    assert f"not kept (No such file or directory: {unwritable}), so each start hashes it again" in second.note
    assert not unwritable.parent.exists()


def test_staged_config_parses_and_names_the_checkpoint(tmp_path):
    """The copy Triton is given: the repository's config with a second parameters list that the text
    format merges into the first; strings escaped (quotes, backslashes, UTF-8)."""
    weights = packed(tmp_path / 'odd "name" \\ é.colibri.safetensors', 'hf "model" \\ ü')
    ident = triton_config.stage_repository(REPO_ROOT / "model_repository", tmp_path / "staged", MODEL, weights)
    staged = tmp_path / "staged" / MODEL
    assert (staged / "1").is_symlink() and (staged / "1" / "model.py").is_file()
    config = text_format.Parse((staged / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    assert parameters["COLIBRI_WARMUP"] == "yes", "the repository's own parameters stay"
    assert {k: v for k, v in parameters.items() if k.startswith("COLIBRI_CHECKPOINT_")} == {
        "COLIBRI_CHECKPOINT_FILE": str(weights), "COLIBRI_CHECKPOINT_BYTES": str(weights.stat().st_size),
        "COLIBRI_CHECKPOINT_MODIFIED": ident.modified,
        "COLIBRI_CHECKPOINT_SHA256": hashlib.sha256(weights.read_bytes()).hexdigest(),
        "COLIBRI_CHECKPOINT_DEMO": "no", "COLIBRI_CHECKPOINT_SOURCE": 'hf "model" \\ ü'}
    # As Triton hands it to model.py (JSON): the identity read back is the one staged.
    as_json = json.loads(json_format.MessageToJson(config, preserving_proto_field_name=True))
    assert triton_config.identity_in_config(as_json) == ident._replace(
        mtime_ns=ident.mtime_ns // 10**9 * 10**9, note="")


def test_stage_refuses_a_repository_without_the_model(tmp_path, colibri_cli, demo):
    (tmp_path / "repo" / "other").mkdir(parents=True)
    result = colibri_cli("stage", tmp_path / "repo", "--weights", demo, "--out", tmp_path / "out")
    assert result.returncode == 1 and result.stderr.strip() == \
        f"colibri stage: {tmp_path / 'repo'} has no {MODEL}/config.pbtxt", result.stderr
    assert not (tmp_path / "out").exists()


def test_model_py_logs_the_checkpoint_it_loaded(demo, monkeypatch):
    lines = []
    monkeypatch.setattr(fake_backend.Logger, "log_info", staticmethod(lines.append))
    fake_backend.load_model(monkeypatch, demo, parameters={"COLIBRI_WARMUP": "no"})
    ident = identity.of(demo)
    served = [line for line in lines if ident.sha256 in line]
    assert len(served) == 1 and served[0].endswith(f"from {ident.describe()}"), lines
    # With the launcher's identity in the config and the file unchanged, that one is used (not re-hashed).
    lines.clear()
    given = triton_config.identity_parameters(ident._replace(sha256="0" * 64))
    fake_backend.load_model(monkeypatch, demo, parameters={"COLIBRI_WARMUP": "no", **given})
    assert any("sha256 " + "0" * 64 in line for line in lines), lines
