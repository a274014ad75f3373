"""`tandem plan --rayservice` against a served Kubernetes API emulator (kmock) holding the
RayService our chart renders, through the real ``kubernetes`` client: the right fields get the
right numbers, a dry run sends nothing, bounds clamp, the cool-down and the dead band hold, and
a refused or missing object is one clear line.

The load comes from two recorded /metrics texts 10 s apart; the profile and the arithmetic:
a prompt of 200 tokens (25 % cached) takes S = 150 / 1000 = 0.15 s; ITL(b) = 20 + 1·b ms.
Targets: TTFT 300 ms, TPOT 50 ms, so b* = 30 and prefill needs ρ = λ·S/P <= 2/3
(S + ρS/(2(1−ρ)) <= 0.3 s). λ = 8: P = 2 (ρ 0.6), D = ceil(8·50·0.05 / 30) = 1;
λ = 9.6 (8 × 1.2): P = 3; λ = 10: P = 3 (ρ 0.5), D = 1; λ = 20: P = 5 (ρ 0.6),
D = ceil(20·50·0.05 / 30) = 2; λ = 30: D = ceil(75 / 30) = 3.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from kubernetes import client

from tandem.services.cli import main
from tandem.services.planner.apply import LAST_CHANGE
from tandem.services.serving.config import AppConfig
from tests.deploy.conftest import CHART_DIR, NAMESPACE, SHARED_SCHEMAS, Helm
from tests.deploy.test_helm_chart import _strict
from tests.planner.kube import Served, served_emulator
from tests.planner.recorded import gateway_metrics

PLANNER_VALUES = CHART_DIR / "ci" / "planner-values.yaml"  # bounds prefill 1-3, decode 2-6
WIDE = ("--set", "planner.bounds.prefill.max=8", "--set", "planner.bounds.decode.min=1",
        "--set", "planner.bounds.decode.max=8",
        "--set", "decode.autoscaling.enabled=false")  # decode fixed at 1, bounds 1-8 each
PROFILE = {"prefill_tokens_per_s": 1000.0, "itl_base_s": 0.020, "itl_per_seq_s": 0.001,
           "max_num_seqs": 64}
WINDOW_S = 10

class Cluster:
    """The emulator holding one RayService, and `tandem plan` pointed at it."""

    def __init__(self, served: Served, tmp_path: Path) -> None:
        self.served = served
        self.tmp_path = tmp_path
        self.kubeconfig = served.kubeconfig(tmp_path)
        self.api = client.CustomObjectsApi(client.ApiClient(
            client.Configuration(host=served.url)))
        self.profile = tmp_path / "profile.json"
        self.profile.write_text(json.dumps(PROFILE))
        self.name = ""

    def create(self, helm: Helm, *args: str) -> dict[str, Any]:
        objects = helm.template("-f", str(PLANNER_VALUES), "--set",
                                "kuberay.skipCapabilityCheck=true", *args)
        (service,) = [o for o in objects if o["kind"] == "RayService"]
        self.name = service["metadata"]["name"]
        self.api.create_namespaced_custom_object("ray.io", "v1", NAMESPACE, "rayservices",
                                                 service)
        return self.read()

    def read(self) -> dict[str, Any]:
        return dict(self.api.get_namespaced_custom_object("ray.io", "v1", NAMESPACE,
                                                          "rayservices", self.name))

    def plan(self, rate: float, *flags: str, name: str | None = None) -> int:
        """`tandem plan` on the load of ``rate`` requests/s (recorded /metrics)."""
        ended = int(rate * WINDOW_S)
        before, after = self.tmp_path / "before.txt", self.tmp_path / "after.txt"
        before.write_text(gateway_metrics(ended=0, prompt=0, generated=0, hits=0))
        after.write_text(gateway_metrics(ended=ended, prompt=200 * ended,
                                         generated=50 * ended, hits=50 * ended))
        return main(["plan", "--profile", str(self.profile), "--ttft-ms", "300",
                     "--tpot-ms", "50", "--metrics", str(before), str(after),
                     "--window", str(WINDOW_S), "--rayservice", name or self.name,
                     "--namespace", NAMESPACE, "--kubeconfig", str(self.kubeconfig), *flags])

    def patches_sent(self) -> int:
        return len(self.served.emulator["patch"])


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with served_emulator() as served:
        yield Cluster(served, tmp_path)


def group(obj: dict[str, Any], role: str) -> dict[str, Any]:
    (found,) = [g for g in obj["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                if g["groupName"] == role]
    return dict(found)


def application(obj: dict[str, Any]) -> dict[str, Any]:
    (app,) = yaml.safe_load(obj["spec"]["serveConfigV2"])["applications"]
    return dict(app)


def deployment(obj: dict[str, Any], role: str) -> dict[str, Any]:
    (found,) = [d for d in application(obj)["deployments"] if d["name"] == role]
    return dict(found)


def assert_valid(obj: dict[str, Any]) -> None:
    """Still a RayService KubeRay's CRD accepts (unknown fields refused), whose serveConfigV2
    Ray Serve's own schema accepts and whose args still load as Tandem's AppConfig."""
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(yaml.safe_load(obj["spec"]["serveConfigV2"]))
    crd = yaml.safe_load((SHARED_SCHEMAS / "kuberay" / "ray.io_rayservices.yaml").read_text())
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    jsonschema.validate(obj, _strict(v1["schema"]["openAPIV3Schema"]),
                        cls=jsonschema.Draft7Validator)
    AppConfig.from_dict(application(obj)["args"], "the patched serveConfigV2")


def without_planned_fields(obj: dict[str, Any]) -> dict[str, Any]:
    """The object less what the planner may change."""
    out = copy.deepcopy(obj)
    out["metadata"].get("annotations", {}).pop(LAST_CHANGE, None)
    for g in out["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        for key in ("replicas", "minReplicas", "maxReplicas"):
            g.pop(key)
    config = yaml.safe_load(out["spec"]["serveConfigV2"])
    for app in config["applications"]:
        for d in app["deployments"]:
            d.pop("num_replicas", None)
            for key in ("min_replicas", "initial_replicas", "max_replicas"):
                d.get("autoscaling_config", {}).pop(key, None)
    out["spec"]["serveConfigV2"] = config
    return out


def test_apply_sets_both_sides_and_nothing_else(cluster: Cluster, helm: Helm,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    before = cluster.create(helm, *WIDE)
    assert cluster.plan(20, "--apply", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == {"prefill": 5, "decode": 2} and report["applied"] is True
    after = cluster.read()
    for role, count in (("prefill", 5), ("decode", 2)):
        # Serve's count (a lightweight update); the worker group's for the next cluster, within
        # the bounds the chart gave it (1-8); the args the gateway started with stay.
        assert deployment(after, role)["num_replicas"] == count
        g = group(after, role)
        assert (g["replicas"], g["minReplicas"], g["maxReplicas"]) == (count, 1, 8)
        assert application(after)["args"][f"{role}_replicas"] == 1
    assert LAST_CHANGE in after["metadata"]["annotations"]
    assert without_planned_fields(after) == without_planned_fields(before)
    assert_valid(after)
    (patch,) = cluster.served.emulator["patch"]
    assert patch.headers["Content-Type"] == "application/merge-patch+json"


def test_dry_run_sends_nothing(cluster: Cluster, helm: Helm,
                               capsys: pytest.CaptureFixture[str]) -> None:
    before = cluster.create(helm, *WIDE)
    assert cluster.plan(20) == 0
    out = capsys.readouterr().out
    assert "plan: 5 prefill + 2 decode workers" in out
    assert "dry run: the merge patch --apply would send:" in out
    assert cluster.patches_sent() == 0
    assert cluster.read() == before


def test_bounds_clamp_and_autoscaling_gets_its_floor(cluster: Cluster, helm: Helm,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    cluster.create(helm)  # bounds prefill 1-3, decode 2-6; decode autoscaled 2-6
    assert cluster.plan(30, "--apply") == 0
    assert "prefill: 7 clamped to 3 by the bounds 1-3" in capsys.readouterr().out
    after = cluster.read()
    assert deployment(after, "prefill")["num_replicas"] == 3
    assert deployment(after, "decode")["autoscaling_config"] | {"target_ongoing_requests": 0} \
        == {"min_replicas": 3, "initial_replicas": 3, "max_replicas": 6,
            "target_ongoing_requests": 0}
    decode = group(after, "decode")
    assert (decode["replicas"], decode["minReplicas"], decode["maxReplicas"]) == (3, 2, 6)
    assert_valid(after)


def test_cool_down_refuses_a_second_change(cluster: Cluster, helm: Helm,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cluster.create(helm, *WIDE)
    assert cluster.plan(10, "--apply") == 0  # 3 + 1
    first = cluster.read()
    assert deployment(first, "prefill")["num_replicas"] == 3
    capsys.readouterr()
    assert cluster.plan(20, "--apply", "--cooldown", "3600") == 0  # wants 5 + 2
    out = capsys.readouterr().out
    assert "cool-down: the last change was" in out and "keeping 3 prefill + 1 decode" in out
    assert cluster.read() == first and cluster.patches_sent() == 1
    assert cluster.plan(20, "--apply", "--cooldown", "0") == 0
    assert deployment(cluster.read(), "prefill")["num_replicas"] == 5


def test_scale_down_inside_the_dead_band_does_nothing(cluster: Cluster, helm: Helm,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    before = cluster.create(helm, *WIDE, "--set", "prefill.replicas=3")
    assert cluster.plan(8, "--apply") == 0  # 2 would do, but 8 × 1.2 needs 3
    assert "stay at 3 (dead band)" in capsys.readouterr().out
    assert cluster.read() == before and cluster.patches_sent() == 0
    assert cluster.plan(8, "--apply", "--margin", "0") == 0
    assert deployment(cluster.read(), "prefill")["num_replicas"] == 2


def test_forbidden_patch_is_one_clear_line(cluster: Cluster, helm: Helm,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cluster.create(helm, *WIDE)
    cluster.served.emulator["patch"] << 403 << {
        "kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
        "code": 403, "message": f'rayservices.ray.io "{cluster.name}" is forbidden'}
    assert cluster.plan(20, "--apply") == 3
    err = capsys.readouterr().err.strip()
    assert err == (f"tandem plan: forbidden: cannot patch rayservices.ray.io '{cluster.name}' in "
                   f"namespace '{NAMESPACE}' (HTTP 403: the credentials lack RBAC permission to "
                   f"patch it); the chart grants get and patch on the release's RayService to "
                   f"the planner's ServiceAccount with planner.enabled=true and "
                   f"planner.rbac.create=true")


def test_missing_rayservice_is_named(cluster: Cluster, helm: Helm,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    cluster.create(helm, *WIDE)
    assert cluster.plan(20, name="nope") == 3
    assert (f"RayService {NAMESPACE}/nope not found (HTTP 404 on get): check --rayservice and "
            f"--namespace") in capsys.readouterr().err
