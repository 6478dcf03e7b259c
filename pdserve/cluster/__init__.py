"""The cluster: controller, routers, instances and the live runtime.

The router registry (:data:`pdserve.cluster.routing.ROUTERS`) is filled here, where the package
is imported: each router module registers its classes.
"""

from pdserve.cluster import cache_routing, macro, prefix_routing, routing, tetri  # noqa: F401
