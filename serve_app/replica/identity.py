"""The id a replica goes by: Ray Serve's own replica id inside Serve.

The same id then names the replica in its log lines, in the engine stats it reports to the
ingress, in the `replica` tag Ray Serve puts on its metrics and in its actor's name, which is how
the ingress tells a replica that left (scaled in, replaced) from one that is silent.
Outside Serve (a replica built directly, as unit tests do) it is a random one.
"""

from __future__ import annotations

import uuid


def replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (RayServeException), or no Ray at all
        return uuid.uuid4().hex[:12]
