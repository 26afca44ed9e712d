"""`modelWeightPath` as a Hugging Face hub id (`owner/name`, optionally `owner/name@revision`).

The snapshot is fetched with huggingface_hub's `snapshot_download` into the Hugging Face cache
(`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`), with its progress bars,
and only the files serving reads: configs, safetensors weights and their index, tokenizer and
chat template files (a repo's *.bin, *.pth, GGUF and ONNX copies of the same weights are often
several times the model's size). With `HF_HUB_OFFLINE=1` only the cache is read. `HF_TOKEN`
(gated and private repos) is read by huggingface_hub itself.

Every process that loads the model (tokenizer pool, model replica, engine process) resolves the
id itself: concurrent downloads into one cache are serialised by huggingface_hub's file locks.
Within a process the first resolution is kept, so the engine process's second look-up, and any
later one, neither asks the hub again nor depends on it being reachable.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from serve_app.models.cache import log

# owner/name as the hub spells them (letters, digits, '-', '_', '.'; validate_repo_id has the
# finer rules), an optional @revision (a branch, tag or commit; branches may hold '/'). A leading
# '/', '.' or '~' never matches, so local paths ('./x', '../x', '~/x', '/x') are never ids.
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^@\s]+))?", re.ASCII)

# What the loaders read (models/loader.py, embedding/encoder.py): transformers' config and
# generation config, safetensors shards and their index, every tokenizer format, chat templates,
# and the sentence-transformers config the encoder takes its length limit from.
ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "spiece.model",
    "sentencepiece*.model",
    "chat_template.json",
    "chat_template.jinja",
    "additional_chat_templates/*",
    "sentence_bert_config.json",
)
# The patterns' '*' also matches '/': sub-folders hold other formats' copies (onnx/,
# openvino/, original/) that transformers never reads from the top level, and Mistral's repos
# carry the whole model a second time as consolidated.safetensors.
IGNORE_PATTERNS = ("*/*.safetensors", "*/*.safetensors.index.json", "*/tokenizer*", "consolidated*")

_resolved: dict[tuple[str, str | None, str], Path] = {}
_lock = threading.Lock()


def parse_hub_id(value: str) -> tuple[str, str | None] | None:
    """(repo_id, revision or None) when value has the shape of a hub id, else None. Only the
    shape: whether a local path of that name exists is the caller's question."""
    match = HUB_ID.fullmatch(value)
    return (match["repo"], match["revision"]) if match else None


def resolve_hub_id(value: str) -> Path:
    """The local snapshot folder of the hub id `value` ('owner/name[@revision]'), downloaded
    into the Hugging Face cache first where need be; the first answer is kept for the process.
    FileNotFoundError, naming modelWeightPath and the id and what to do, when it cannot be had."""
    from huggingface_hub import constants

    parsed = parse_hub_id(value)
    if parsed is None:
        raise ValueError(f"{value!r} is not a Hugging Face hub id (owner/name[@revision])")
    repo, revision = parsed
    # read when called, not when imported: huggingface_hub reads them at its import
    cache, offline = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    key = (repo, revision, cache)
    with _lock:  # several threads of one process then wait for one download
        if key not in _resolved:
            _resolved[key] = _fetch(value, repo, revision, cache, offline)
        return _resolved[key]


def _fetch(value: str, repo: str, revision: str | None, cache: str, offline: bool) -> Path:
    from huggingface_hub import snapshot_download

    if not offline:
        note = "files already there are not downloaded again"
        log(value, f"fetching from the Hugging Face hub into {cache} ({note}) ...")
    try:
        folder = snapshot_download(
            repo,
            revision=revision,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=list(ALLOW_PATTERNS),
            ignore_patterns=list(IGNORE_PATTERNS),
            library_name="serve_app",
        )
    except Exception as exc:
        reason = _reason(exc, offline, revision)
        raise FileNotFoundError(_unavailable(value, repo, revision, cache, reason)) from exc
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"modelWeightPath {value!r}: the Hugging Face hub repository has no config.json at "
            "its top level, so it is not a transformers model; give the id of a model "
            "repository, or a local folder of HF weights"
        )
    if not any(path.glob("*.safetensors")):
        raise FileNotFoundError(
            f"modelWeightPath {value!r}: the Hugging Face hub repository has no *.safetensors "
            "weights at its top level, and serve_app loads no other format (*.bin, *.pth, GGUF, "
            "ONNX); convert them to safetensors into a local folder and give that folder"
        )
    if not offline:
        log(value, f"ready at {path}")
    return path


def _reason(exc: Exception, offline: bool, revision: str | None) -> str:
    """Why the snapshot could not be had, in a user's terms."""
    from huggingface_hub import errors

    # huggingface_hub wraps a connection error in its own; the cause says what happened
    cause = exc.__cause__ if isinstance(exc.__cause__, Exception) else exc
    text = str(cause).strip()
    detail = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
    # (not in every huggingface_hub version the dependency floor allows)
    incomplete = getattr(errors, "IncompleteSnapshotError", ())
    if isinstance(exc, incomplete):
        return f"its snapshot in the Hugging Face cache is missing files ({exc})"
    if offline and isinstance(exc, errors.LocalEntryNotFoundError):
        return "HF_HUB_OFFLINE=1 is set and it is not in the Hugging Face cache"
    if isinstance(exc, errors.GatedRepoError):
        return (
            "the repository is gated: accept its terms on its hub page and export HF_TOKEN (a "
            "token of that account) where the replicas run"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return (
            "the hub has no such repository (or it is private and HF_TOKEN does not give "
            "access to it)"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"the repository has no revision {revision!r}"
    if isinstance(exc, errors.HFValidationError):
        return f"it is not a valid hub id ({detail})"
    if isinstance(exc, errors.LocalEntryNotFoundError):
        return f"the hub could not be reached ({detail}) and it is not in the Hugging Face cache"
    return detail


def _unavailable(value: str, repo: str, revision: str | None, cache: str, reason: str) -> str:
    folder = "models--" + repo.replace("/", "--")
    command = f"{repo} --revision {revision}" if revision else repo
    return (
        f"modelWeightPath {value!r} is not a local folder, and as a Hugging Face hub id it "
        f"could not be fetched: {reason}. Download it on a machine with network access "
        f"(`hf download {command}`, or `huggingface-cli download {command}` with an older "
        f"huggingface_hub) and copy its cache folder {folder} into {cache} here (or point "
        "HF_HUB_CACHE at a copy of that cache), or give modelWeightPath a local folder of its "
        "weights."
    )
