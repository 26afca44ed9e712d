"""The benchmarks: each entry point runs as `python -m bench.<name>` from the repository root
(bench/README.md lists them); `common`, `peers`, `roofline`, `hf_systems`, `serve_report`,
`pd_report`, `server_process`, `proc_cpu` and `sse_client` are what they share."""
