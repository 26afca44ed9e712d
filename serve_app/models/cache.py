"""The model cache: built-in models are built once into a folder here, atomically and locked.

`$SERVE_APP_CACHE`, else `~/.cache/serve_app`. Each build writes into a temporary sibling folder
and renames it into place, so a crashed build leaves nothing half-written; concurrent processes
(several replicas starting together) wait on a lock file and then find the folder built.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get("SERVE_APP_CACHE") or Path.home() / ".cache" / "serve_app"
    return Path(cache_dir).expanduser().absolute()


def log(name: str, message: str) -> None:
    print(f"{name}: {message}", file=sys.stderr, flush=True)


def build_atomically(out_dir: str | Path, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on an empty temporary sibling of out_dir, then rename it to out_dir.

    out_dir must not exist yet, or be empty. If a concurrent builder wins the rename, its copy
    is kept."""
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        write(tmp)
        if (tmp / "tokenizer_config.json").is_file():
            note_tokenizer_class(tmp)
        for path in tmp.iterdir():  # mkdtemp and safetensors create owner-only files
            path.chmod(0o644)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # a concurrent builder finished first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# What AutoTokenizer picks for a folder built here, noted by the builder (which has torch and
# transformers loaded anyway): AutoTokenizer decides from the model's config, and transformers'
# config module imports torch, which a process that only tokenizes (the tokenizer pool, a model
# replica whose engine runs in its own process) would otherwise load for that alone.
TOKENIZER_CLASS_FILE = "serve_app_tokenizer.json"


def note_tokenizer_class(folder: Path) -> None:
    from transformers import AutoTokenizer

    name = type(AutoTokenizer.from_pretrained(str(folder), local_files_only=True)).__name__
    (folder / TOKENIZER_CLASS_FILE).write_text(json.dumps({"tokenizer_class": name}) + "\n")


def noted_tokenizer_class(folder: Path) -> str | None:
    """The class name note_tokenizer_class recorded in folder, None where there is none."""
    try:
        return json.loads((folder / TOKENIZER_CLASS_FILE).read_text())["tokenizer_class"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def ensure_built(folder: str, build: Callable[[Path], object], cache_dir=None) -> Path:
    """cache_root/folder, calling build(path) first if it holds no config.json yet (one builder
    per cache at a time; the others wait and find it built)."""
    root = cache_root(cache_dir)
    target = root / folder
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{folder}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            build(target)
    return target
