"""Frozen configuration dataclasses, validated in ``__post_init__``, one module per idea:
``base`` (the names configs validate against, shared helpers), ``model``, ``engine`` and
``deployment``; every name is imported from here (``from pdserve.config import ClusterConfig``).

One dataclass per layer: :class:`ModelConfig` (architecture facts read from a Hugging Face
``config.json``; torch-free so the simulator can use it), :class:`CacheConfig` (KV block pool),
:class:`SchedulerConfig` (iteration scheduler of one instance), :class:`EngineConfig` (one
model instance = the three above plus device/dtype/seed) and :class:`ClusterConfig`, **the one
deployment spec**: roles (count, parallelism, per-role engine settings), routers, KV links and
node layout. The live runtime and the simulator both build their instances from
:meth:`ClusterConfig.instance_specs`, and size KV pools with :func:`kv_cache_blocks` (a simulated
instance's with :func:`simulated_kv_blocks`).

Every field that is a command-line flag carries its help text in ``metadata["help"]``;
:mod:`pdserve.flags` generates the flags from these fields.
"""

from pdserve.config.base import (
    ADMISSION_POLICIES,
    DTYPE_BYTES,
    DTYPES,
    FLIP_POLICIES,
    KV_CACHE_DTYPES,
    KV_DTYPE_BYTES,
    LENGTH_PREDICTORS,
    QUANTIZATIONS,
    ROLES,
    SCHEDULING_POLICIES,
    GiB,
    Role,
    cdiv,
    load_data_file,
    read_text,
)
from pdserve.config.deployment import (
    BACKENDS,
    FLAT_KEYS,
    LINKS_FILE,
    STRATEGIES,
    ClusterConfig,
    InstanceSpec,
    Link,
    MacroConfig,
    PredictorConfig,
    RoleSpec,
    check_granularity,
    flip_settings,
    get_link,
    link_catalogue,
)
from pdserve.config.engine import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    check_pool_holds_a_request,
    default_token_budget,
    engine_reserved_bytes,
    kv_cache_blocks,
    simulated_kv_blocks,
)
from pdserve.config.model import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = [
    "ADMISSION_POLICIES", "BACKENDS", "DTYPES", "DTYPE_BYTES", "FLAT_KEYS", "FLIP_POLICIES",
    "KV_CACHE_DTYPES", "KV_DTYPE_BYTES", "LENGTH_PREDICTORS", "LINKS_FILE", "QUANTIZATIONS",
    "ROLES", "SCHEDULING_POLICIES", "STRATEGIES",
    "SUPPORTED_ARCHITECTURES", "CacheConfig", "ClusterConfig", "EngineConfig", "GiB",
    "InstanceSpec", "Link", "MacroConfig", "ModelConfig", "PredictorConfig", "Role", "RoleSpec",
    "SchedulerConfig", "cdiv", "check_granularity", "check_pool_holds_a_request",
    "default_token_budget", "engine_reserved_bytes", "flip_settings", "get_link",
    "kv_cache_blocks", "link_catalogue",
    "load_data_file", "read_text", "simulated_kv_blocks",
]
