"""Hub ids (`org/name`) resolved through huggingface_hub's cache, offline (jaxspec.io.hub).

The cache is laid out as huggingface_hub writes it (`models--org--name/` with `blobs/`,
`snapshots/<commit>/` links into them and `refs/main`), under a temporary HF_HUB_CACHE, with
HF_HUB_OFFLINE=1: no network is touched.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

import numpy as np
import pytest

import jaxspec
from jaxspec.errors import CheckpointError
from jaxspec.io import gguf_export, hub
from jaxspec.profiling import roofline

pytest.importorskip("huggingface_hub")

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _tiny() -> jaxspec.TargetModel:
  config = roofline.dense_config(
    hidden=32, layers=1, intermediate=64, vocab=64, head_dim=16, kv_heads=1
  )
  return jaxspec.TargetModel.random(config.with_options(scan_layers=False), seed=5)


def _cache_repo(cache, repo: str, files_dir) -> None:
  """Puts the files of `files_dir` into the hub cache layout of `repo` (blobs + links)."""
  root = cache / f"models--{repo.replace('/', '--')}"
  snapshot = root / "snapshots" / COMMIT
  (root / "blobs").mkdir(parents=True)
  snapshot.mkdir(parents=True)
  (root / "refs").mkdir()
  (root / "refs" / "main").write_text(COMMIT)
  for name in os.listdir(files_dir):
    data = (files_dir / name).read_bytes()
    blob = root / "blobs" / hashlib.sha256(data).hexdigest()
    blob.write_bytes(data)
    (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))


@pytest.fixture(scope="module")
def offline_cache(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("hub")
  model = _tiny()
  saved = tmp / "saved"
  jaxspec.save_hf(model, str(saved))
  cache = tmp / "cache"
  _cache_repo(cache, "tiny-org/tiny-model", saved)
  if importlib.util.find_spec("gguf") is not None:  # a GGUF repository: one file of it named
    (tmp / "gguf").mkdir()
    gguf_export.write_gguf(model.config, model.params, str(tmp / "gguf" / "tiny-F32.gguf"))
    _cache_repo(cache, "tiny-org/tiny-model-GGUF", tmp / "gguf")
  return model, cache


@pytest.fixture
def offline(offline_cache, monkeypatch):
  monkeypatch.setenv("HF_HUB_CACHE", str(offline_cache[1]))
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  return offline_cache


def test_hub_id_loads_from_the_cache_offline(offline):
  model, cache = offline
  loaded = jaxspec.load_model("tiny-org/tiny-model")
  ids = np.array([[1, 2, 3, 4]])
  np.testing.assert_allclose(
    np.asarray(loaded.logits(ids)), np.asarray(model.logits(ids)), atol=1e-6, rtol=0
  )
  assert hub.resolve("tiny-org/tiny-model").startswith(str(cache))


def test_hub_gguf_file_loads_from_the_cache_offline(offline):
  pytest.importorskip("gguf")
  model, _ = offline
  loaded = jaxspec.load_model("tiny-org/tiny-model-GGUF/tiny-F32.gguf")
  ids = np.array([[1, 2, 3, 4]])
  np.testing.assert_allclose(
    np.asarray(loaded.logits(ids)), np.asarray(model.logits(ids)), atol=1e-5, rtol=0
  )


def test_uncached_id_offline_is_a_clear_error(offline):
  with pytest.raises(CheckpointError, match=r"'tiny-org/absent'.*HF_HUB_OFFLINE"):
    jaxspec.load_model("tiny-org/absent")


def test_a_local_path_wins(offline, tmp_path, monkeypatch):
  model, _ = offline
  local = jaxspec.TargetModel(model.config, _tiny_params(model, seed=6))
  monkeypatch.chdir(tmp_path)
  jaxspec.save_hf(local, "tiny-org/tiny-model")  # a directory named like the cached id
  assert hub.resolve("tiny-org/tiny-model") == "tiny-org/tiny-model"
  ids = np.array([[1, 2, 3, 4]])
  got = np.asarray(jaxspec.load_model("tiny-org/tiny-model").logits(ids))
  np.testing.assert_allclose(got, np.asarray(local.logits(ids)), atol=1e-6, rtol=0)
  assert np.abs(got - np.asarray(model.logits(ids))).max() > 1e-3


def _tiny_params(model: jaxspec.TargetModel, seed: int):
  return jaxspec.TargetModel.random(model.config, seed=seed).params


def test_what_is_and_is_not_a_hub_id():
  assert hub.is_hub_id("Qwen/Qwen3-0.6B") and hub.is_hub_id("org/repo/model-Q4_K_M.gguf")
  for name in ("./org/name", "/abs/path", "a/b/c", "../up/x", "name", "~/org/name"):
    assert not hub.is_hub_id(name), name
