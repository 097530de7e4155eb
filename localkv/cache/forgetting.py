"""What ``cache forget FILE`` looks for: the document's tokens under every cached model.

A block holds a document if its tokens contain a run of the document's
tokens, whatever wrote it (``prefill``, ``ask``, a chat's ``/attach``), so
forgetting needs the document tokenized as each model that wrote blocks
would tokenize it. ``tokenizer_models`` finds those models: the one the
usual model options name, and every model file the cache's
``filehashes.db`` recorded whose content hash is some stored identity's
``model_sha256``. ``document_runs`` tokenizes the text with each model's
vocabulary alone (no weights, no context), so this stays cheap.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from localkv.model.find import ModelNotFoundError, resolve_model
from localkv.model.native import ensure_backend, llama_cpp
from localkv.model.vocab import tokenize
from localkv.storage.filehash import recorded_paths
from localkv.storage.store import SnapshotStore

__all__ = ["document_runs", "tokenizer_models"]

log = logging.getLogger(__name__)

_FILE_HASHES = "filehashes.db"


def tokenizer_models(store: SnapshotStore, explicit: str | None) -> list[Path]:
    """The model files whose vocabularies may have tokenized what the cache holds.

    First the model ``--model``, ``LOCALKV_MODEL`` or the default model names
    (skipped, with a log line, when none resolves), then every existing file
    recorded under a stored identity's model hash. Distinct resolved paths.
    """
    found: list[Path] = []
    try:
        found.append(resolve_model(explicit))
    except ModelNotFoundError as exc:
        log.info("no model from the model options: %s", exc)
    found.extend(recorded_paths(store.root / _FILE_HASHES, _identity_models(store)))
    return list(dict.fromkeys(p.resolve() for p in found))


def _identity_models(store: SnapshotStore) -> set[str]:
    """The ``model_sha256`` of every identity the cache has stored."""
    out: set[str] = set()
    for (text,) in store.db.execute("SELECT json FROM identities").fetchall():
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            sha = json.loads(text).get("model_sha256")
            if isinstance(sha, str):
                out.add(sha)
    return out


def document_runs(text: str, model_paths: Sequence[Path]) -> list[np.ndarray]:
    """``text`` tokenized by each model's vocabulary: int32 arrays, one per model loaded.

    Plain text, as a document is tokenized inside a prompt: no BOS, special
    tokens' text not parsed. A model that cannot be loaded is skipped with a
    warning; an empty list means no tokenizer was available.
    """
    ensure_backend()
    runs: list[np.ndarray] = []
    for path in model_paths:
        tokens = _tokenize_with_vocab(Path(path), text)
        if tokens is not None:
            runs.append(tokens)
    return runs


def _tokenize_with_vocab(path: Path, text: str) -> np.ndarray | None:
    """Load ``path``'s vocabulary only and tokenize ``text``; None if it cannot be loaded."""
    mparams = llama_cpp.llama_model_default_params()
    mparams.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        log.warning("could not load the vocabulary of %s; its tokens are not searched", path)
        return None
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        ids = tokenize(vocab, text, add_special=False, parse_special=False)
        return np.array(ids, dtype=np.int32)
    except ValueError:
        log.warning("%s could not tokenize the document", path)
        return None
    finally:
        llama_cpp.llama_model_free(model)
