"""modelWeightPath as a Hugging Face hub id, offline: a Hugging Face cache laid out as
huggingface_hub writes it (refs/, snapshots/ of symlinks, blobs/) holding a copy of demo-tiny,
HF_HUB_OFFLINE=1, and a stand-in hub on localhost for the hub's refusals. Nothing here reaches
the network."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants
from huggingface_hub.utils import filter_repo_objects

from serve_app.config import load_config
from serve_app.models import hub
from serve_app.models.demo import ensure_demo_model
from serve_app.models.loader import load_model, load_tokenizer, resolve_model_path
from serve_app.tokenizer.pool import TokenizerPool

REPO = "owner/tiny-chat"
MAIN = "0123456789abcdef0123456789abcdef01234567"
V1 = "89abcdef0123456789abcdef0123456789abcdef"
ROOT = Path(__file__).resolve().parents[2]


def git_blob_id(data: bytes) -> str:
    """The blob name huggingface_hub gives a file kept in git (its etag: git's blob sha1)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo: str, commit: str, files: dict[str, Path], ref: str | None):
    """Write `files` (name -> source file) as the snapshot `commit` of `repo` into the cache as
    huggingface_hub does: each file's content once in blobs/ (LFS files by their sha256,
    others by their git blob id), the snapshot's files relative symlinks to them, and
    refs/<ref> holding the commit hash (no newline)."""
    storage = cache / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    for name, source in files.items():
        data = source.read_bytes()
        lfs = name.endswith(".safetensors")
        blob = hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)
        (storage / "blobs").mkdir(parents=True, exist_ok=True)
        (storage / "blobs" / blob).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(storage / "blobs" / blob, link.parent))
    if ref is not None:
        (storage / "refs").mkdir(parents=True, exist_ok=True)
        (storage / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_demo_model("demo-tiny")


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny) -> Path:
    """An offline Hugging Face cache holding REPO at MAIN (refs/main) and at V1 (tag v1, with a
    generation config of its own), as the environment a replica would start in.
    huggingface_hub read HF_HUB_CACHE and HF_HUB_OFFLINE when it was imported, before this
    test, so its constants are set as well (test_environment_alone checks the variables alone
    in a fresh interpreter)."""
    cache = tmp_path / "hf" / "hub"
    files = {p.name: p for p in sorted(tiny.iterdir())}
    add_snapshot(cache, REPO, MAIN, files, ref="main")
    other = tmp_path / "generation_config.json"
    other.write_text('{"eos_token_id": 151645, "max_length": 7}')
    add_snapshot(cache, REPO, V1, {**files, "generation_config.json": other}, ref="v1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub, "_resolved", {})  # each test starts with nothing resolved
    return cache


def snapshot(cache: Path, commit: str) -> Path:
    return (cache / "models--owner--tiny-chat" / "snapshots" / commit).resolve()


def test_hub_id_resolves_to_its_snapshot(hf_cache):
    assert resolve_model_path(REPO) == snapshot(hf_cache, MAIN)
    assert (resolve_model_path(REPO) / "config.json").is_file()


def test_revision(hf_cache):
    assert resolve_model_path(f"{REPO}@v1") == snapshot(hf_cache, V1)
    assert resolve_model_path(f"{REPO}@{V1}") == snapshot(hf_cache, V1)  # a commit hash
    assert resolve_model_path(f"{REPO}@main") == snapshot(hf_cache, MAIN)
    with pytest.raises(FileNotFoundError, match=f"modelWeightPath '{REPO}@v2'"):
        resolve_model_path(f"{REPO}@v2")


def test_model_and_tokenizer_load_from_the_snapshot(hf_cache, tiny):
    path = resolve_model_path(REPO)
    tokenizer = load_tokenizer(path)
    assert tokenizer.eos_token_id == load_tokenizer(tiny).eos_token_id == 151645
    assert tokenizer.encode("Hello, world") == load_tokenizer(tiny).encode("Hello, world")
    model = load_model(path, torch.float32, torch.device("cpu"))
    reference = load_model(tiny, torch.float32, torch.device("cpu"))
    ids = torch.tensor([tokenizer.encode("Hello, my name is")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    v1 = load_model(resolve_model_path(f"{REPO}@v1"), torch.float32, torch.device("cpu"))
    assert v1.generation_config.max_length == 7  # the tag's own generation config


def test_tokenizer_pool_serves_a_hub_id(hf_cache):
    model = {"modelName": "tiny", "modelWeightPath": REPO, "dtype": "float32"}
    config = load_config({"BackendConfig": {"ModelDeployConfig": {"ModelConfig": [model]}}})
    pool = TokenizerPool(config)
    assert pool.model_info("tiny")["eos_token_id"] == 151645


def test_not_cached_says_what_to_do(hf_cache):
    with pytest.raises(FileNotFoundError) as error:
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(error.value)
    assert message.startswith("modelWeightPath 'Qwen/Qwen2.5-0.5B-Instruct'")
    assert "HF_HUB_OFFLINE=1" in message and str(hf_cache) in message
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in message
    assert "models--Qwen--Qwen2.5-0.5B-Instruct" in message and "local folder" in message


def test_resolved_once_per_process(hf_cache):
    """The engine process resolves the path twice (to hand it to its parent, then to load):
    the second answer comes from the first, without the hub or even the cache's refs."""
    first = resolve_model_path(REPO)
    (hf_cache / "models--owner--tiny-chat" / "refs" / "main").unlink()
    assert resolve_model_path(REPO) == first
    hub._resolved.clear()  # a fresh process would find nothing now
    with pytest.raises(FileNotFoundError):
        resolve_model_path(REPO)


def test_failures_are_not_kept(hf_cache, tiny):
    with pytest.raises(FileNotFoundError):
        resolve_model_path("owner/later")
    files = {name: tiny / name for name in ("config.json", "model.safetensors")}
    add_snapshot(hf_cache, "owner/later", MAIN, files, ref="main")
    later = hf_cache / "models--owner--later" / "snapshots" / MAIN
    assert resolve_model_path("owner/later") == later.resolve()


def test_incomplete_snapshot(hf_cache):
    """huggingface_hub (2.x) keeps each commit's file list; a snapshot missing a listed file
    (an interrupted download) is not served half."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    entry = tree_cache.TreeCacheEntry(size=1, blob_id=MAIN)
    storage = str(hf_cache / "models--owner--tiny-chat")
    names = ["config.json", "model.safetensors", "tokenizer.json", "model-2.safetensors"]
    tree_cache.write_tree_cache(storage, MAIN, {name: entry for name in names})
    with pytest.raises(FileNotFoundError, match=f"modelWeightPath '{REPO}'.*missing files"):
        resolve_model_path(REPO)


def test_not_a_servable_repo(hf_cache, tiny):
    add_snapshot(hf_cache, "owner/bin-only", MAIN, {"config.json": tiny / "config.json"}, "main")
    with pytest.raises(FileNotFoundError, match="'owner/bin-only'.*no \\*.safetensors"):
        resolve_model_path("owner/bin-only")
    add_snapshot(hf_cache, "owner/dataset-like", MAIN, {"a.txt": tiny / "config.json"}, "main")
    with pytest.raises(FileNotFoundError, match="'owner/dataset-like'.*no config.json"):
        resolve_model_path("owner/dataset-like")


def test_local_folders_and_built_ins_come_first(hf_cache, tiny, tmp_path, monkeypatch):
    assert resolve_model_path("demo-tiny") == tiny
    assert resolve_model_path(str(tiny)) == tiny
    # a relative folder spelled like a hub id is the folder
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny, tmp_path / REPO)
    assert resolve_model_path(REPO) == tmp_path / REPO
    (tmp_path / "owner" / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="'owner/empty' has no config.json"):
        resolve_model_path("owner/empty")
    for path in ("/models/x", "./owner/x", "../owner/x", "~/owner/x", "a/b/c", "nothing"):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            resolve_model_path(path)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("Qwen/Qwen2.5-0.5B-Instruct", ("Qwen/Qwen2.5-0.5B-Instruct", None)),
        ("meta-llama/Llama-3.2-1B@refs/pr/3", ("meta-llama/Llama-3.2-1B", "refs/pr/3")),
        ("o_1/n.2@" + V1, ("o_1/n.2", V1)),
        ("/models/qwen", None),
        ("./owner/name", None),
        ("~/name", None),
        ("owner/name/sub", None),
        ("owner/", None),
        ("owner/name@", None),
        ("demo", None),
    ],
)
def test_hub_id_shape(value, parsed):
    assert hub.parse_hub_id(value) == parsed


def test_only_what_serving_reads_is_fetched():
    listing = [
        "config.json", "generation_config.json", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
        "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json", "vocab.json",
        "merges.txt", "chat_template.jinja", "additional_chat_templates/tool_use.jinja",
        "sentence_bert_config.json",
        # not needed: other formats of the same weights, docs, sub-folders' copies
        "pytorch_model.bin", "pytorch_model.bin.index.json", "consolidated.safetensors",
        "original/consolidated.00.pth", "model.gguf", "onnx/model.onnx", "onnx/tokenizer.json",
        "openvino/openvino_model.bin", "flax_model.msgpack", "tf_model.h5", "README.md",
        ".gitattributes", "params.json", "1_Pooling/config.json", "onnx/model.safetensors",
    ]  # fmt: skip
    allow, ignore = list(hub.ALLOW_PATTERNS), list(hub.IGNORE_PATTERNS)
    fetched = list(filter_repo_objects(listing, allow_patterns=allow, ignore_patterns=ignore))
    assert fetched == listing[: listing.index("sentence_bert_config.json") + 1]


def test_online_asks_the_hub_with_the_patterns(hf_cache, monkeypatch):
    """Online, snapshot_download may download (huggingface_hub's own progress bars, HF_TOKEN);
    offline, it is told to read the cache only."""
    import huggingface_hub

    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(snapshot(hf_cache, MAIN))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert resolve_model_path(f"{REPO}@v1") == snapshot(hf_cache, MAIN)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    resolve_model_path(REPO)
    (repo, online), (_, offline) = calls
    assert repo == REPO and online["revision"] == "v1" and offline["revision"] is None
    assert online["local_files_only"] is False and offline["local_files_only"] is True
    assert online["cache_dir"] == str(hf_cache)
    assert "*.safetensors" in online["allow_patterns"]
    assert "token" not in online  # huggingface_hub reads HF_TOKEN itself


class StandInHub(http.server.BaseHTTPRequestHandler):
    """Answers every request as the hub answers for a repo that is missing, gated, or has no
    such revision (hf_raise_for_status reads the X-Error-Code header)."""

    answers = {
        "missing": (404, "RepoNotFound"),
        "gated": (401, "GatedRepo"),
        "norev": (404, "RevisionNotFound"),
    }

    def do_GET(self):  # noqa: N802 (http.server's name)
        kind = next((k for k in self.answers if f"/owner/{k}" in self.path), "missing")
        status, code = self.answers[kind]
        body = b'{"error": "stand-in hub"}'
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def online(hf_cache, monkeypatch):
    """Online, against a stand-in hub on localhost."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandInHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize(
    ("repo", "says"),
    [
        ("owner/missing", "the hub has no such repository .*HF_TOKEN"),
        ("owner/gated", "the repository is gated: accept its terms .*HF_TOKEN"),
        ("owner/norev@v9", "the repository has no revision 'v9'.*--revision v9"),
    ],
)
def test_the_hubs_refusals_say_what_to_do(online, repo, says):
    with pytest.raises(
        FileNotFoundError, match=f"^modelWeightPath '{repo}' .*{says}.*local folder"
    ):
        resolve_model_path(repo)


def test_unreachable_hub_falls_back_to_the_cache(hf_cache, monkeypatch):
    """Online, but the hub does not answer: the cached snapshot is served; an id not cached
    says that the hub could not be reached."""
    with socket.socket() as s:  # a localhost port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert resolve_model_path(REPO) == snapshot(hf_cache, MAIN)
    with pytest.raises(FileNotFoundError, match="'owner/other'.*could not be reached"):
        resolve_model_path("owner/other")


def test_environment_alone(hf_cache):
    """In a fresh interpreter (as a replica starts) HF_HUB_CACHE and HF_HUB_OFFLINE=1 in the
    environment are all it takes."""
    env = {**os.environ, "HF_HUB_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HOME", None)
    code = (
        "import sys; from serve_app.models.loader import resolve_model_path; "
        "print(resolve_model_path(sys.argv[1]))"
    )
    command = [sys.executable, "-c", code, REPO]
    done = subprocess.run(command, env=env, cwd=ROOT, text=True, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == snapshot(hf_cache, MAIN)


def test_engine_process_loads_a_hub_id(hf_cache):
    """The engine process (a fresh interpreter, the environment inherited) resolves the id
    twice, to hand the folder to its parent and to load it, from the cache alone; an id that
    is not cached fails the start with the message, as a missing folder does."""
    from serve_app.engine import EngineConfig
    from serve_app.engine.host.async_engine import AsyncEngine

    config = EngineConfig(model=REPO, dtype="float32", num_kv_blocks=16, engine_process=True)
    engine = AsyncEngine(config)
    try:
        assert Path(engine.info.model_path) == snapshot(hf_cache, MAIN)
        assert engine.tokenizer.eos_token_id == 151645
    finally:
        engine.shutdown()
    with pytest.raises(RuntimeError, match="modelWeightPath 'owner/absent'.*HF_HUB_OFFLINE=1"):
        AsyncEngine(config.replace(model="owner/absent"))
    with pytest.raises(FileNotFoundError, match="modelWeightPath 'owner/absent'"):
        AsyncEngine(config.replace(model="owner/absent", engine_process=False))
