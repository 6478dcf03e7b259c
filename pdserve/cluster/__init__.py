"""The cluster: controller, routers, instances and the live runtime.

The router registry (:data:`pdserve.cluster.routing.ROUTERS`) is filled here, where the package
is imported: each router module registers its classes.
"""

from pdserve.cluster import (  # noqa: F401
    cache_routing,
    decode_dispatch,
    macro,
    prefix_routing,
    routing,
)
