"""Ray backend (extra ``ray``): ``RaySampler`` runs the ``Sampler``'s interface across a Ray
cluster, one actor per node, each with a local ``Sampler`` over local env processes and the
policy on the node. Ray is imported here and nowhere else in envmanager."""

from envmanager.ray.nodes import RayNodeError, RayNodeRestartLimitError
from envmanager.ray.sampler import RaySampler
from envmanager.ray.session import RaySession, RaySessionError

__all__ = ["RayNodeError", "RayNodeRestartLimitError", "RaySampler", "RaySession", "RaySessionError"]
