"""One model instance: block pool, scheduler, policies, executor, engine (torch only in the
model executor)."""

# the registries of this package are filled here, where the package is imported
from pdserve.engine import admission, policies, prefill_order  # noqa: F401
