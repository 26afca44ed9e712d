"""TokenizerPool without Ray: each prompt kind, the token-count rules, chat templates."""

import asyncio
import subprocess
import sys

import pytest

from serve_app.config import load_config
from serve_app.messages import Rejection, TokenizedPrompt, TokenizeRequest
from serve_app.tokenizer.pool import TokenizerPool

pytestmark = pytest.mark.usefixtures("one_tokenizer_per_model")

IM_START, IM_END = 151644, 151645


def config(truncation=False):
    model = {"modelWeightPath": "demo-tiny", "dtype": "float32"}
    return {
        "BackendConfig": {
            "ModelDeployConfig": {
                "maxSeqLen": 512,
                "maxInputTokenLen": 256,
                "truncation": truncation,
                "ModelConfig": [{**model, "modelName": "demo"}, {**model, "modelName": "other"}],
            },
            "ScheduleConfig": {"maxIterTimes": 64, "maxPrefillTokens": 256},
        }
    }


@pytest.fixture(scope="module")
def pool():
    return TokenizerPool(load_config(config()))


@pytest.fixture(scope="module")
def cutting_pool():
    return TokenizerPool(load_config(config(truncation=True)))


def test_a_pool_of_a_built_model_does_not_load_torch(pool):
    # torch costs a tokenizer replica seconds of CPU at start and ~0.4 GB; it needs none of it
    code = (
        "import sys\nfrom serve_app.config import load_config\n"
        "from serve_app.tokenizer.pool import TokenizerPool\n"
        f"TokenizerPool(load_config({config()!r}))\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


@pytest.fixture(scope="module")
def tok(pool):
    return pool._models["demo"].tokenizer


def tokenize(pool, **kw):
    return asyncio.run(pool.tokenize(TokenizeRequest(**{"model": "demo", **kw})))


def long_text(num_tokens, tok):
    text = " ".join(f"word{i}" for i in range(num_tokens))
    assert len(tok.encode(text)) > num_tokens
    return text


def test_models_and_info(pool):
    assert pool.model_names() == ["demo", "other"]
    info = pool.model_info("demo")
    assert info["vocab_size"] == 151936 and info["max_position_embeddings"] == 4096
    assert info["completion_prompt_limit"] == 256  # min(256, 512 - 1, 4096, 2^20)
    assert info["chat_prompt_limit"] == 448  # min(512 - 64, 4096)
    assert pool.limits("other").max_iter_times == 64
    with pytest.raises(KeyError):
        pool.model_info("nope")


@pytest.mark.parametrize("kind", ["completion", "text"])
def test_text_prompt(pool, tok, kind):
    out = tokenize(pool, kind=kind, text="Hello, 世界!")
    assert isinstance(out, TokenizedPrompt)
    assert out.prompt_token_ids == tok.encode("Hello, 世界!")
    assert out.num_prompt_tokens == len(out.prompt_token_ids) and not out.truncated


@pytest.mark.parametrize("kind", ["completion", "text"])
def test_text_too_long(pool, tok, kind):
    out = tokenize(pool, kind=kind, text=long_text(300, tok), param="text_input")
    assert isinstance(out, Rejection)
    assert (out.kind, out.param) == ("validation", "text_input")
    assert "256" in out.message and "text_input" in out.message


def test_truncation_keeps_the_tail(cutting_pool, tok):
    text = long_text(300, tok)
    out = tokenize(cutting_pool, kind="completion", text=text)
    assert out.truncated and out.num_prompt_tokens == 256
    assert out.prompt_token_ids == tok.encode(text)[-256:]


def test_empty_prompt_is_validation(pool):
    out = tokenize(pool, kind="completion", text="")
    assert isinstance(out, Rejection) and (out.kind, out.param) == ("validation", "prompt")
    assert tokenize(pool, kind="completion", text=None).kind == "validation"


def test_unknown_model(pool):
    out = asyncio.run(pool.tokenize(TokenizeRequest(model="gpt-9", kind="completion", text="x")))
    assert isinstance(out, Rejection)
    assert (out.kind, out.param) == ("not_found", "model") and "demo" in out.message


MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the weather?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]},
    {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
]


def test_chat_template_roles(pool, tok):
    out = tokenize(pool, kind="chat", messages=MESSAGES)
    assert isinstance(out, TokenizedPrompt)
    text = out.prompt_text
    for role in ("system", "user", "assistant", "tool"):
        assert f"<|im_start|>{role}\n" in text
    assert "<|im_start|>tool\nsunny<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")  # the generation prompt
    assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(IM_START) == 6 and out.prompt_token_ids.count(IM_END) == 5


def test_chat_counts_template_tokens(pool, tok):
    out = tokenize(pool, kind="chat", messages=[{"role": "user", "content": "hi"}])
    # <|im_start|> user \n hi <|im_end|> \n <|im_start|> assistant \n
    assert out.num_prompt_tokens == len(tok.encode("hi")) + 8
    assert out.prompt_token_ids[0] == IM_START


def test_chat_text_parts_equal_string(pool):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tokenize(pool, kind="chat", messages=[{"role": "user", "content": parts}])
    as_text = tokenize(pool, kind="chat", messages=[{"role": "user", "content": "first\nsecond"}])
    assert as_parts.prompt_token_ids == as_text.prompt_token_ids


@pytest.mark.parametrize(
    "messages, param, kind",
    [
        ([], "messages", "validation"),
        ([{"content": "no role"}], "messages[0]", "validation"),
        ([{"role": "user", "content": 5}], "messages[0].content", "validation"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
            "unsupported",
        ),
    ],
)
def test_chat_bad_messages(pool, messages, param, kind):
    out = tokenize(pool, kind="chat", messages=messages)
    assert isinstance(out, Rejection) and (out.param, out.kind) == (param, kind)


def test_chat_template_error(pool, tok, monkeypatch):
    monkeypatch.setattr(tok, "chat_template", "{{ raise_exception('roles must alternate') }}")
    out = tokenize(pool, kind="chat", messages=[{"role": "user", "content": "hi"}])
    assert isinstance(out, Rejection) and (out.kind, out.param) == ("validation", "messages")
    assert "roles must alternate" in out.message


def test_chat_too_long(pool, cutting_pool, tok):
    messages = [{"role": "user", "content": long_text(500, tok)}]
    out = tokenize(pool, kind="chat", messages=messages)
    assert isinstance(out, Rejection)
    assert (out.kind, out.param) == ("validation", "messages") and "448" in out.message
    cut = tokenize(cutting_pool, kind="chat", messages=messages)
    assert cut.truncated and cut.num_prompt_tokens == 448
    assert cut.prompt_token_ids[-3:] == tok.encode("<|im_start|>assistant\n")


def test_token_ids(pool):
    out = tokenize(pool, kind="token_ids", token_ids=[0, 1, 151642], param="input_id")
    assert out.prompt_token_ids == [0, 1, 151642] and out.num_prompt_tokens == 3


@pytest.mark.parametrize(
    "ids, kind, words",
    [
        ([5, 151936], "validation", "input_id[1]"),
        ([5, -1], "validation", "[0, 151935]"),
        ([], "validation", "between 1 and 256"),
        (list(range(1, 301)), "validation", "256"),
    ],
)
def test_token_ids_rejected(pool, ids, kind, words):
    out = tokenize(pool, kind="token_ids", token_ids=ids, param="input_id")
    assert isinstance(out, Rejection) and (out.kind, out.param) == (kind, "input_id")
    assert words in out.message


def test_token_ids_truncated(cutting_pool):
    out = tokenize(cutting_pool, kind="token_ids", token_ids=list(range(1, 301)))
    assert out.truncated and out.prompt_token_ids == list(range(45, 301))


def test_decode(pool, tok):
    ids = tok.encode("Hello, 世界!") + [IM_END]
    assert asyncio.run(pool.decode("demo", ids)) == "Hello, 世界!"
    assert asyncio.run(pool.decode("demo", ids, skip_special_tokens=False)).endswith("<|im_end|>")
