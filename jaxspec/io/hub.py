"""Hugging Face hub ids ("org/name") resolved to local checkpoint paths, as every peer does.

`resolve` turns what a user passes as a model (a directory, a file, or a hub id) into a local
path. A path that exists wins. Otherwise an id of the form `org/name` is fetched through
`huggingface_hub` (its cache, `HF_HUB_CACHE` / `HF_HOME`; `HF_HUB_OFFLINE=1` honoured: only the
cache is read), and `org/name/file.gguf` names one GGUF file of such a repository. Only the
files a checkpoint needs are fetched (config, weights, tokenizer, template), not a repository's
every variant. Anything else is returned unchanged, for the caller's own "does not exist".
"""

from __future__ import annotations

import os
import re

from jaxspec.errors import CheckpointError

# Files of a checkpoint directory: config and weights, tokenizer and chat template.
CHECKPOINT_PATTERNS = (
  "*.json",
  "*.safetensors",
  "*.jinja",
  "*.model",
  "*.tiktoken",
  "*.txt",
)
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO = re.compile(rf"({_NAME})/({_NAME})")
_REPO_FILE = re.compile(rf"({_NAME}/{_NAME})/(.+\.gguf)", re.IGNORECASE)


def is_hub_id(name: str) -> bool:
  """Whether `name` reads as a hub id (`org/name` or `org/name/file.gguf`)."""
  if not isinstance(name, str) or name.startswith((".", "/", "~")) or ".." in name:
    return False
  return bool(_REPO.fullmatch(name) or _REPO_FILE.fullmatch(name))


def resolve(name: str, patterns: tuple[str, ...] = CHECKPOINT_PATTERNS) -> str:
  """A local path for `name`: itself when it exists (or is no hub id), else the hub cache's.

  `patterns` are the files of a repository to fetch (`huggingface_hub`'s allow_patterns).
  Raises CheckpointError when the id is neither cached nor downloadable (offline, no such
  repository, no network), naming it and what was tried.
  """
  if not isinstance(name, str) or os.path.exists(name) or not is_hub_id(name):
    return name
  try:
    import huggingface_hub  # pylint: disable=import-outside-toplevel
    from huggingface_hub import constants as hub_constants  # pylint: disable=import-outside-toplevel
    from huggingface_hub import errors as hub_errors  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise CheckpointError(
      f"{name!r} is not a local path, and resolving it as a hub id needs huggingface_hub "
      "(pip install huggingface_hub)"
    ) from None
  offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")
  cache = os.environ.get("HF_HUB_CACHE") or hub_constants.HF_HUB_CACHE
  single = _REPO_FILE.fullmatch(name)
  try:
    if single:
      repo, filename = single.groups()
      return huggingface_hub.hf_hub_download(
        repo, filename, cache_dir=cache, local_files_only=offline
      )
    return huggingface_hub.snapshot_download(
      name, allow_patterns=list(patterns), cache_dir=cache, local_files_only=offline
    )
  except (hub_errors.HfHubHTTPError, hub_errors.LocalEntryNotFoundError, OSError, ValueError) as e:
    where = "in the local hub cache (HF_HUB_OFFLINE is set)" if offline else "on the hub"
    first = str(e).splitlines()[0] if str(e) else ""
    raise CheckpointError(
      f"{name!r} does not exist locally, and as a hub id it was not found {where} "
      f"(cache: {cache}): {type(e).__name__}: {first}"
    ) from None
