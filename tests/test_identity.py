"""The served checkpoint's identity (colibri.identity): path, size, modification time, a sha256 of the
whole file kept beside it while the file is unchanged, demo or not."""
import hashlib
import os
import subprocess

import numpy as np
import pytest

from colibri import checkpoint, identity
from colibri.config import LayerConfig


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
