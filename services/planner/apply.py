"""Read the RayService, and patch its worker counts, through the Kubernetes API.

What the planner sets, for each role (``prefill``, ``decode``), and nothing else:

* in ``spec.serveConfigV2`` (a YAML string), the role's Serve deployment options: with Serve
  autoscaling (an ``autoscaling_config``) its ``min_replicas`` and ``initial_replicas`` to the
  count and ``max_replicas`` to at least it (the planner sets the floor, Serve absorbs peaks
  above it); without, ``num_replicas``. Both are Serve's lightweight updates: replicas are
  added or removed, none restarted. The application's ``args`` (``<role>_replicas``: what the
  gateway waits for at start) are left alone: a change there would rebuild the application and
  restart every engine;
* ``spec.rayClusterConfig.workerGroupSpecs[groupName=role].replicas`` to the count (and
  ``minReplicas``/``maxReplicas`` widened to hold it). KubeRay does not carry these to a
  running RayCluster (kuberay#2331: it leaves pod counts to the Ray autoscaler); they size the
  next cluster it rolls out. The running cluster's pods follow Serve's replicas through the
  Ray autoscaler, which the chart turns on with the planner, between the groups' bounds;
* ``metadata.annotations["tandem.dev/planner-last-change"]``: when (UTC), for the cool-down.

One JSON merge patch (custom resources take no strategic merge patch, and a merge patch
replaces a list whole, so ``workerGroupSpecs`` goes entire) carrying the object's
``resourceVersion``: a RayService changed since it was read is refused (409), not overwritten.
"""

from __future__ import annotations

import copy
import datetime as dt
from dataclasses import dataclass
from typing import Any

import yaml

from tandem.services.extras import require
from tandem.services.planner.policy import ROLES, Bounds

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayservices"
LAST_CHANGE = "tandem.dev/planner-last-change"
BOUNDS = "tandem.dev/planner-{role}-bounds"  # "MIN-MAX", rendered by the chart
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT_S = 10
RBAC_HINT = ("the chart grants get and patch on the release's RayService to the planner's "
             "ServiceAccount with planner.enabled=true and planner.rbac.create=true")


class ApplyError(RuntimeError):
    """The Kubernetes API refused or could not be reached: one line that says what to do."""


@dataclass(frozen=True)
class Target:
    name: str
    namespace: str

    def describe(self) -> str:
        return f"RayService {self.namespace}/{self.name}"


def api_client(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A ``CustomObjectsApi``: from ``kubeconfig`` when given, else in-cluster (a pod's
    ServiceAccount) when there, else ``~/.kube/config``."""
    client = require("kubernetes.client", "tandem plan --apply")
    config = require("kubernetes.config", "tandem plan --apply")
    if kubeconfig is None:
        try:
            config.load_incluster_config()
            return client.CustomObjectsApi()
        except config.ConfigException:
            pass
    try:
        return client.CustomObjectsApi(config.new_client_from_config(config_file=kubeconfig,
                                                                     context=context))
    except (config.ConfigException, OSError) as exc:
        raise ApplyError(f"no Kubernetes configuration: {exc} (--kubeconfig, or run in a pod "
                         f"with a ServiceAccount)") from None


def _failure(exc: Exception, verb: str, target: Target) -> ApplyError:
    from kubernetes.client.exceptions import ApiException

    if not isinstance(exc, ApiException):
        return ApplyError(f"cannot reach the Kubernetes API to {verb} {target.describe()}: "
                          f"{exc}")
    where = f"rayservices.ray.io {target.name!r} in namespace {target.namespace!r}"
    if exc.status == 403:
        return ApplyError(f"forbidden: cannot {verb} {where} (HTTP 403: the credentials lack "
                          f"RBAC permission to {verb} it); {RBAC_HINT}")
    if exc.status == 401:
        return ApplyError(f"unauthenticated: the Kubernetes API refused the credentials to "
                          f"{verb} {where} (HTTP 401)")
    if exc.status == 404:
        return ApplyError(f"{target.describe()} not found (HTTP 404 on {verb}): check "
                          f"--rayservice and --namespace")
    if exc.status == 409:
        return ApplyError(f"{target.describe()} changed while the planner read it (HTTP 409): "
                          f"nothing applied; the next round reads it again")
    return ApplyError(f"cannot {verb} {where}: HTTP {exc.status} {exc.reason}")


def read(api: Any, target: Target) -> dict[str, Any]:
    try:
        return dict(api.get_namespaced_custom_object(GROUP, VERSION, target.namespace, PLURAL,
                                                     target.name,
                                                     _request_timeout=REQUEST_TIMEOUT_S))
    except Exception as exc:  # ApiException, or urllib3's connection errors
        raise _failure(exc, "get", target) from None


def send(api: Any, target: Target, patch: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(api.patch_namespaced_custom_object(GROUP, VERSION, target.namespace, PLURAL,
                                                       target.name, patch,
                                                       _content_type=MERGE_PATCH,
                                                       _request_timeout=REQUEST_TIMEOUT_S))
    except Exception as exc:
        raise _failure(exc, "patch", target) from None


# ------------------------------------------------------------------ reading the object


def _application(serve_config: dict[str, Any], name: str) -> dict[str, Any]:
    apps = serve_config.get("applications") or []
    if len(apps) != 1:
        raise ApplyError(f"{name}: serveConfigV2 has {len(apps)} applications; the planner "
                         f"knows Tandem's one")
    return dict(apps[0])


def _deployment(app: dict[str, Any], role: str) -> dict[str, Any] | None:
    return next((d for d in app.get("deployments") or [] if d.get("name") == role), None)


def _group(obj: dict[str, Any], role: str) -> dict[str, Any]:
    groups = obj["spec"]["rayClusterConfig"].get("workerGroupSpecs") or []
    found = next((g for g in groups if g.get("groupName") == role), None)
    if found is None:
        raise ApplyError(f"RayService {obj['metadata']['name']} has no worker group {role!r}: "
                         f"the planner sizes disaggregated prefill and decode pools (a "
                         f"colocated cluster has none)")
    return dict(found)


def serve_config(obj: dict[str, Any]) -> dict[str, Any]:
    return dict(yaml.safe_load(obj["spec"]["serveConfigV2"]))


def current_counts(obj: dict[str, Any]) -> dict[str, int]:
    """Each role's count as the Serve application has it: the autoscaling floor, the
    deployment's ``num_replicas``, or the application's ``<role>_replicas``."""
    app = _application(serve_config(obj), obj["metadata"]["name"])
    counts = {}
    for role in ROLES:
        _group(obj, role)  # both groups exist
        options = _deployment(app, role) or {}
        scaling = options.get("autoscaling_config")
        if scaling:
            counts[role] = int(scaling["min_replicas"])
        elif isinstance(options.get("num_replicas"), int):
            counts[role] = options["num_replicas"]
        else:
            counts[role] = int(app.get("args", {}).get(f"{role}_replicas", 1))
    return counts


def bounds_of(obj: dict[str, Any]) -> dict[str, Bounds]:
    """Each role's bounds from the chart's annotations (none: 1 and no maximum)."""
    annotations = obj["metadata"].get("annotations") or {}
    found = {}
    for role in ROLES:
        text = annotations.get(BOUNDS.format(role=role))
        found[role] = Bounds.parse(text) if text else Bounds()
    return found


def last_change(obj: dict[str, Any]) -> dt.datetime | None:
    text = (obj["metadata"].get("annotations") or {}).get(LAST_CHANGE)
    return dt.datetime.fromisoformat(text) if text else None


# ------------------------------------------------------------------ the patch


def build_patch(obj: dict[str, Any], counts: dict[str, int], now: dt.datetime) -> dict[str, Any]:
    """The merge patch that sets ``counts`` (see the module's docstring)."""
    config = serve_config(obj)
    app = _application(config, obj["metadata"]["name"])
    groups = copy.deepcopy(obj["spec"]["rayClusterConfig"]["workerGroupSpecs"])
    for role, count in counts.items():
        group = next(g for g in groups if g.get("groupName") == role)
        group["replicas"] = count
        group["minReplicas"] = min(count, int(group.get("minReplicas", count)))
        group["maxReplicas"] = max(count, int(group.get("maxReplicas", count)))
        options = _deployment(app, role)
        if options is None:
            options = {"name": role}
            app.setdefault("deployments", []).append(options)
        scaling = options.get("autoscaling_config")
        if scaling:
            scaling["min_replicas"] = scaling["initial_replicas"] = count
            scaling["max_replicas"] = max(count, int(scaling.get("max_replicas", count)))
        else:
            options["num_replicas"] = count
    config["applications"] = [app]
    metadata: dict[str, Any] = {"annotations": {LAST_CHANGE: now.isoformat(timespec="seconds")}}
    if obj["metadata"].get("resourceVersion"):
        metadata["resourceVersion"] = obj["metadata"]["resourceVersion"]
    return {"metadata": metadata,
            "spec": {"serveConfigV2": yaml.safe_dump(config, sort_keys=False),
                     "rayClusterConfig": {"workerGroupSpecs": groups}}}
