"""Simulator: latency models, hardware and model catalogues (torch-free) and the event loop.

Importing this package loads only the torch-free latency layer; the event loop lives in
:mod:`pdserve.sim.simulator` and is imported from there.
"""

from pdserve.sim.analytic import AnalyticModel, Efficiency
from pdserve.sim.hardware import (
    ClusterSpec,
    DeviceSpec,
    LinkSpec,
    get_device,
    get_link,
    list_devices,
    list_links,
    load_hardware,
)
from pdserve.sim.latency import (
    FittedProfile,
    LatencyModel,
    PipelineModel,
    ProfileSample,
    fit_profile,
    fit_relative,
    kv_transfer_time,
    pipeline_finish_times,
    profile_grid,
    profile_model,
)
from pdserve.sim.model_catalogue import get_model_config, list_models

__all__ = [
    "AnalyticModel", "ClusterSpec", "DeviceSpec", "Efficiency", "FittedProfile", "LatencyModel",
    "LinkSpec",
    "PipelineModel", "ProfileSample", "fit_profile", "fit_relative", "get_device", "get_link",
    "get_model_config", "kv_transfer_time", "list_devices", "list_links", "list_models",
    "load_hardware",
    "pipeline_finish_times", "profile_grid", "profile_model",
]
