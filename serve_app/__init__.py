"""serve_app: an LLM inference server for Ascend NPU clusters, built as a Ray Serve application.

Request path: ingress (HTTP) -> tokenizer pool -> model replicas (engine). See README.md.
"""

__version__ = "0.1.0"
