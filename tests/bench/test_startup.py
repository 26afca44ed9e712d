"""bench/startup.py finds its steps in the lines the server prints (a change to those lines must
change its patterns, not silently drop a step)."""

from __future__ import annotations

from bench.startup import MARKS

# lines as `python -m serve_app deployments.yaml` prints them (Ray's prefixes and colours off)
OUTPUT = """\
INFO 2026-12-02 11:12:44,457 serve 16095 -- Started Serve in namespace "serve".
(ServeController pid=1) INFO 2026-12-02 11:12:46,513 controller 1 -- Adding 1 replica to \
Deployment(name='ModelReplica', app='serve_app').
(ServeReplica:serve_app:ModelReplica pid=2) model replica 999a42831d6e (colocated): loading \
'smollm2-135m-instruct' ...
(ServeReplica:serve_app:EmbeddingReplica pid=3) embedding replica dd215f56cbfe: loading \
'all-minilm-l6-v2' for endpoint 'all-minilm-l6-v2' ...
(ServeReplica:serve_app:EmbeddingReplica pid=3) embedding replica dd215f56cbfe: \
'all-minilm-l6-v2' ready (384 dimensions, inputs up to 256 tokens)
(ServeReplica:serve_app:ModelReplica pid=2) model replica 999a42831d6e: 'smollm2-135m-instruct' \
ready on cpu (torch.bfloat16, 728 KV blocks, 1 torch thread)
serve_app ready at http://127.0.0.1:8000  (docs: http://127.0.0.1:8000/docs)
"""


def test_every_step_is_found_once_in_order():
    lines = OUTPUT.splitlines()
    found = {step: [i for i, line in enumerate(lines) if pattern.search(line)]
             for step, pattern, _ in MARKS}  # fmt: skip
    assert all(len(where) == 1 for where in found.values()), found
    for step, _, after in MARKS:
        if after is not None:
            assert found[after][0] < found[step][0], (after, step)


def test_the_replicas_print_what_the_bench_looks_for():
    """The patterns match the replicas' own messages, made by their code."""
    import inspect

    from serve_app.replica import embedding_replica, model_replica

    model = inspect.getsource(model_replica)
    assert "({role}): loading" in model and "ready on {info.device}" in model
    embedding = inspect.getsource(embedding_replica)
    assert "{self.replica_id}: loading" in embedding and "{self.endpoint!r} ready" in embedding
