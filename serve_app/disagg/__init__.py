"""Prefill/decode disaggregation: moving a prompt's KV cache from a prefill replica to a decode
replica.

Place in the request path (inferMode dmi): the ingress sends the request to a prefill replica,
which samples the first token and stages the prompt's KV through a `KVConnector`; the ingress
streams that token, then hands the `KVTransfer` to a decode replica, which fetches the KV
through the same connector, imports it into its own pool and streams the rest. The engine side
(export, import, the payload format) is `serve_app.engine.kv_transfer`.
"""
