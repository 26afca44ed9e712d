"""The token socket: a replica's chunks straight to the ingress that asked, over a local socket,
instead of through Ray's streaming (docs/lifecycle.md). `frame` is what crosses it, `outbox` the
replica's side (a link per ingress on its node: one of the two sinks of `replica.relay`),
`inbox` the ingress's side."""
