"""Serve config -> KubeRay ``RayService`` manifest (``meshctl kuberay``).

A ``RayService`` (``apiVersion: ray.io/v1``) holds two things, and KubeRay treats them
differently:

- ``spec.serveConfigV2``: the Serve config, as a YAML string. KubeRay applies an edit of it in
  place (the same PUT as ``serve deploy``), so every mesh flow that edits a Serve config
  (weights, adapters, rollouts, swaps) works unchanged on Kubernetes.
- ``spec.rayClusterConfig``: the Ray cluster. KubeRay answers most edits of it by building a
  new cluster and switching traffic to it once its applications run (zero-downtime upgrade).

The Serve config goes in as it is, with one change: ``http_options.host`` becomes
``0.0.0.0``. On a pod, Serve's proxy must listen on the pod's address, not on loopback, or
neither KubeRay's serve Service nor its health checks reach it. The port is kept (default
8000), and so are ``proxy_location`` (``EveryNode`` suits Kubernetes: a proxy on every pod
that runs a replica) and every deployment's ``autoscaling_config``.

Every pod's container gets the mesh's Serve settings as its environment, which ``ray start``
reads (:func:`serve_app.common.serve_env.serve_env` for the chosen ingress). With the
``haproxy`` ingress, HAProxy takes the serve port on each pod with a proxy (KubeRay's Service
and its ``/-/healthz`` checks reach it there, as they reach Serve's proxy), and forwards to the
router replicas' own ports, which ``0.0.0.0`` opens to the other pods; Ray starts it through
the image's ``mesh-haproxy`` launcher (:data:`IMAGE_HAPROXY_LAUNCHER`).

The cluster is derived from the variant applications (``import_path:
serve_app.replica:build_app``): each ``LLMReplica`` replica gets a Ray worker pod sized from
its ``ray_actor_options``; the router (``MeshRouter``) and the ``RolloutController`` run on
the head.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import yaml

from serve_app.common.serve_configs import applications, mesh_parts
from serve_app.common.serve_env import serve_env
from serve_app.common.engine_resources import ACCELERATOR_RESOURCE
from serve_app.release.kuberay_fleet import (Fleet, head_pod_additions, load_fleet,
                                            worker_pod_additions)
from serve_app.release.kuberay_workers import (WorkerGroup, autoscales, format_quantity,
                                              parse_quantity, whole, worker_groups)

API_VERSION = "ray.io/v1"
KIND = "RayService"
DEFAULT_NAME = "model-mesh"
DEFAULT_IMAGE = "model-mesh:latest"
DEFAULT_HEAD_CPUS = 2
DEFAULT_HEAD_MEMORY = "8Gi"
#: Memory of a worker pod when nothing sizes it: a CPU replica whose ray_actor_options state
#: none, or a GPU replica whose model's size is not known here (no weights fetched, no
#: parameter count in its name).
DEFAULT_WORKER_MEMORY = "8Gi"
#: The ``mesh-haproxy`` launcher (:mod:`serve_app.common.haproxy_launch`) in the image:
#: deploy/kuberay/Dockerfile installs the package into the Ray image's Python, whose console
#: scripts are in /home/ray/anaconda3/bin (the Dockerfile checks it is there).
IMAGE_HAPROXY_LAUNCHER = "/home/ray/anaconda3/bin/mesh-haproxy"
#: Where Serve's proxy listens on a pod: every address of the pod.
POD_HOST = "0.0.0.0"
METRICS_PORT = 8080  # KubeRay's default metrics-export-port for every Ray pod
#: KubeRay refuses longer RayService names (it appends 6 characters for the RayCluster name,
#: whose limit is 53).
MAX_NAME_LENGTH = 47
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: A container image reference, ``[host[:port]/]path[:tag][@algorithm:hex]``, by the grammar
#: every container runtime parses (github.com/distribution/reference, ``regexp.go``): path
#: components of lowercase letters and digits joined by ``.``, ``_``, ``__`` or dashes.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_IMAGE_REFERENCE = re.compile(
    rf"^(?:(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|\[[a-fA-F0-9:]+\])(?::[0-9]+)?/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")
#: Longest image name (without tag and digest) the grammar allows.
MAX_IMAGE_NAME_LENGTH = 255


def image_problem(image: str) -> str | None:
    """Why ``image`` is not a container image reference a Kubernetes pod can pull, or None."""
    if not image.strip():
        return "empty; name the image built from deploy/kuberay/Dockerfile"
    name = image.split("@")[0]
    if ":" in name.rsplit("/", 1)[-1]:
        name = name.rsplit(":", 1)[0]
    if not _IMAGE_REFERENCE.match(image) or len(name) > MAX_IMAGE_NAME_LENGTH:
        return (f"got {image!r}, which is not a container image reference: "
                "[registry[:port]/]name[:tag][@sha256:digest], the name in lowercase letters, "
                "digits and . _ - / (e.g. registry.example.com/model-mesh:1.0); name the "
                "image built from deploy/kuberay/Dockerfile")
    return None


class ManifestError(ValueError):
    """The config or the options cannot make a manifest; ``problems`` has one line each,
    ``<path.of.field>: <problem>``."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def rayservice_manifest(config: dict[str, Any], *, name: str = DEFAULT_NAME,
                        image: str = DEFAULT_IMAGE, namespace: str | None = None,
                        head_cpus: int = DEFAULT_HEAD_CPUS,
                        head_memory: str = DEFAULT_HEAD_MEMORY,
                        worker_memory: str = DEFAULT_WORKER_MEMORY,
                        spare_workers: int = 0, ingress: str | None = None,
                        overlay: Any = None) -> dict[str, Any]:
    """The KubeRay ``RayService`` for a Serve config of the mesh, as a dict (dump it with
    :func:`manifest_yaml`).

    Args:
        config: a Serve config (what ``serve deploy`` takes), as parsed from YAML; not modified.
        name: ``metadata.name``, a DNS-1035 label of at most 47 characters.
        image: the image of every pod; it must hold the repository (``serve_app``,
            ``adapters/``, ``models/``): ``deploy/kuberay/Dockerfile``.
        namespace: ``metadata.namespace``; None leaves it to ``kubectl``.
        head_cpus: CPUs of the head pod (whole), which runs the router, the rollout controller,
            Serve's controller and the GCS.
        head_memory, worker_memory: Kubernetes quantities (``8Gi``, ``512Mi``, bytes).
            ``worker_memory`` is a worker pod's memory when nothing sizes it (see Worker
            groups). KubeRay passes a pod's memory limit to Ray as the node's ``memory``, so
            a replica that asks for memory fits its pod.
        spare_workers: pods each worker group may add past its engines' maximum (for Serve's
            surge replacements and blue/green variants); > 0 turns on the Ray autoscaler.
        ingress: ``proxy`` or ``haproxy``; None: ``$MESH_INGRESS``, else the mesh's default
            (:mod:`serve_app.common.serve_env`). Its settings are every container's ``env``.
        overlay: a fleet file's content, parsed (:mod:`serve_app.release.kuberay_fleet`):
            secrets, the cache volume, node selectors and tolerations; None: the defaults.

    Worker groups: the ``LLMReplica`` of each variant application, with the config's
    ``ray_actor_options`` when it has some (they replace the code's whole, as in Serve; a
    missing ``num_cpus`` is Serve's default 1) and else those of ``REPLICA_OPTIONS``
    (:mod:`serve_app.common.deployment_options`). Variants of one shape (GPUs per pod,
    accelerator type, custom resource names) share a group, in the order of the
    applications, so a variant of a new shape adds a group at the end. Per pod
    (:func:`~serve_app.release.kuberay_workers.pod_size`): ``cpu`` the CPUs Ray asks for
    (``num_cpus`` or the bundles', rounded up, at least 1), ``memory`` the memory it asks for,
    ``nvidia.com/gpu`` its GPUs rounded up (and the ``num-gpus`` ray start parameter); for a
    GPU replica at least what its engine runs
    (:func:`~serve_app.common.engine_resources.engine_need`: CPUs for the actor, the engine
    core and each GPU worker, memory for them and the weights), else ``worker_memory``;
    custom ``resources`` and the accelerator type's resource through the ``resources`` ray
    start parameter; the largest variant of a group sizes its pods. Counts:
    ``replicas`` = the sum of ``num_replicas`` (Serve's default 1), or of
    ``autoscaling_config`` ``initial_replicas`` (default ``min_replicas``);
    ``minReplicas`` = the sum of ``num_replicas`` or ``min_replicas``; ``maxReplicas`` = the
    sum of ``num_replicas`` or ``max_replicas``, plus ``spare_workers``.
    ``enableInTreeAutoscaling`` is true when a deployment autoscales or a group's
    ``maxReplicas`` exceeds its ``minReplicas``.

    Raises:
        ManifestError (a ValueError): every problem at once, one line each: Ray's
            ``ServeDeploySchema``, the mesh's :func:`~serve_app.release.validate.validate_config`
            (run on the config as deployed, with the pod host), and bad options.
    """
    import ray

    problems = _option_problems(name=name, image=image, head_cpus=head_cpus,
                                spare_workers=spare_workers)
    fleet = Fleet()
    try:
        fleet = overlay if isinstance(overlay, Fleet) else load_fleet(overlay)
    except ValueError as e:
        problems += str(e).splitlines()
    try:
        env = [{"name": k, "value": v}
               for k, v in serve_env(ingress, IMAGE_HAPROXY_LAUNCHER).items()]
    except ValueError as e:
        problems.append(f"ingress: {e}")
    quantities = {}
    for option, value in (("head_memory", head_memory), ("worker_memory", worker_memory)):
        try:
            quantities[option] = parse_quantity(value)
        except ValueError as e:
            problems.append(f"{option}: {e}")
    serve_config = pod_serve_config(config)
    problems += serve_config_problems(serve_config)
    if problems:
        raise ManifestError(problems)

    groups = worker_groups(serve_config, worker_memory=quantities["worker_memory"],
                           spare_workers=spare_workers)
    autoscaling = any(autoscales(d) for a in applications(serve_config)
                      for d in a.get("deployments") or []) or any(
        g.max_replicas > g.min_replicas for g in groups)
    serve_port = serve_config["http_options"]["port"]
    metadata: dict[str, Any] = {"name": name}
    if namespace:
        metadata["namespace"] = namespace
    metadata["labels"] = {"app.kubernetes.io/name": "model-mesh"}
    head_resources = {"cpu": str(head_cpus), "memory": head_memory}
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "serveConfigV2": yaml.dump(serve_config, Dumper=_Dumper, sort_keys=False,
                                       width=4096),
            "rayClusterConfig": {
                "rayVersion": ray.__version__,
                "enableInTreeAutoscaling": autoscaling,
                "headGroupSpec": {
                    "rayStartParams": {"dashboard-host": "0.0.0.0"},
                    "template": {"spec": {**head_pod_additions(fleet), "containers": [{
                        "name": "ray-head",
                        "image": image,
                        "env": env,
                        "resources": {"requests": dict(head_resources),
                                      "limits": dict(head_resources)},
                        "ports": [
                            {"containerPort": 6379, "name": "gcs-server"},
                            {"containerPort": 8265, "name": "dashboard"},
                            {"containerPort": 10001, "name": "client"},
                            {"containerPort": serve_port, "name": "serve"},
                            {"containerPort": METRICS_PORT, "name": "metrics"},
                        ],
                    }]}},
                },
                "workerGroupSpecs": [_group_spec(g, image, env, fleet, name) for g in groups],
            },
        },
    }


def pod_serve_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``config`` whose proxy listens on the pod: ``http_options.host: 0.0.0.0``,
    the port kept (Serve's default 8000 written out when absent). Nothing else changes."""
    from ray.serve.schema import HTTPOptionsSchema

    out = copy.deepcopy(config)
    http = out.get("http_options")
    http = dict(http) if isinstance(http, dict) else {}
    http["host"] = POD_HOST
    http.setdefault("port", HTTPOptionsSchema.model_fields["port"].default)
    out["http_options"] = http
    return out


def serve_config_problems(serve_config: dict[str, Any]) -> list[str]:
    """Problems of a Serve config, one line each: :func:`validate_config` (Ray's
    ``ServeDeploySchema`` first, then, when that passes, the mesh's own checks); the same
    under either ingress."""
    from serve_app.release.validate import validate_config

    return [line for p in validate_config(serve_config)
            for line in p.splitlines()]


def manifest_warnings(serve_config: dict[str, Any], manifest: dict[str, Any], *,
                      overlay: Any = None,
                      worker_memory: str = DEFAULT_WORKER_MEMORY) -> list[str]:
    """What is valid but works poorly on Kubernetes, one line each (printed, not refused).
    ``serve_config``, ``overlay``, ``worker_memory``: what the manifest was made from."""
    warnings = []
    fleet = overlay if isinstance(overlay, Fleet) else load_fleet(overlay)
    for g in worker_groups(pod_serve_config(serve_config),
                           worker_memory=parse_quantity(worker_memory)):
        if g.gpus and g.unsized:
            warnings.append(
                f"workerGroupSpecs[{g.name}]: the host memory of {', '.join(g.unsized)} is not "
                f"known here (no weights fetched on this host, no parameter count such as 8B "
                f"in the model's name), so its pods get --worker-memory ({worker_memory}); "
                "vLLM reads the weights through host memory: set ray_actor_options.memory "
                "(bytes), or --worker-memory, to the weights' size + 6Gi (docs/gpu-fleet.md, "
                "\"Pod sizing\")")
        accelerator = fleet.accelerators.get(g.accelerator_type or "")
        if g.accelerator_type and not (fleet.workers.node_selector
                                       or (accelerator and accelerator.node_selector)):
            warnings.append(
                f"workerGroupSpecs[{g.name}]: its variants need {g.accelerator_type} GPUs, and "
                "no node selector keeps its pods on such nodes (Ray would wait for a "
                f"{g.accelerator_type} node forever if one landed elsewhere): name the node "
                f"label in the fleet file, accelerators: {{{g.accelerator_type}: "
                "{node_selector: {nvidia.com/gpu.product: ...}}} (meshctl kuberay --overlay; "
                "docs/gpu-fleet.md, \"The fleet file\")")
    location = serve_config.get("proxy_location", "EveryNode")
    if location != "EveryNode":
        warnings.append(
            f"proxy_location: {location}: only the head pod runs a Serve proxy, so all HTTP "
            "traffic enters there; EveryNode runs one on every pod with a replica, and "
            "KubeRay's serve Service sends traffic to the pods whose proxy is healthy")
    cluster = manifest["spec"]["rayClusterConfig"]
    head_cpus = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["cpu"]
    for g in cluster["workerGroupSpecs"]:
        if "num-gpus" not in g["rayStartParams"] and "resources" not in g["rayStartParams"]:
            warnings.append(
                f"workerGroupSpecs[{g['groupName']}]: its engines ask Ray only for CPUs, and "
                "Ray places replicas by resources, not by pod: one may start on the head pod "
                f"({head_cpus} CPUs) or beside another engine on one worker pod. To keep one "
                "engine per worker pod, give LLMReplica a custom resource, e.g. "
                "ray_actor_options: {num_cpus: 1, resources: {mesh_engine: 1}} (or num_gpus)")
    return warnings


def pod_sizing(serve_config: dict[str, Any], *,
               worker_memory: str = DEFAULT_WORKER_MEMORY) -> list[str]:
    """How each worker group's pods were sized, one line per variant
    (``workerGroupSpecs[engines-gpu2-h100]: llama-v2: 4 CPUs, 31Gi, 2 GPU(s) (its engine on
    2 GPU(s): ...)``), for the manifest's comment. ``serve_config``: a valid config."""
    groups = worker_groups(pod_serve_config(serve_config),
                           worker_memory=parse_quantity(worker_memory))
    return [f"workerGroupSpecs[{g.name}]: {line}" for g in groups for line in g.sizing]


def manifest_yaml(manifest: dict[str, Any], *, source: str | None = None,
                  sizing: list[str] | None = None) -> str:
    """The manifest as YAML text, ``serveConfigV2`` as a literal block, after a comment that
    says where it came from (and ``sizing``: :func:`pod_sizing`'s lines)."""
    command = f"meshctl kuberay {source}" if source else "meshctl kuberay"
    head = (f"# KubeRay RayService written by `{command}`: edit the Serve config, regenerate.\n"
            "# serveConfigV2: the Serve config with http_options.host 0.0.0.0 (the proxy "
            "listens on the pod).\n"
            "# env: the mesh's Serve settings, read by ray start on every pod "
            "(python -m serve_app.common.serve_env).\n"
            "# KubeRay applies serveConfigV2 edits in place; a rayClusterConfig edit builds a "
            "new cluster,\n"
            "# then switches traffic to it (docs/past-one-machine.md, \"Kubernetes with KubeRay\").\n"
            + "".join(f"# sized: {line}\n" for line in sizing or []))
    body = copy.deepcopy(manifest)
    body["spec"]["serveConfigV2"] = _Literal(body["spec"]["serveConfigV2"])
    return head + yaml.dump(body, Dumper=_Dumper, sort_keys=False, width=4096)


def _option_problems(*, name: str, image: str, head_cpus: int, spare_workers: int) -> list[str]:
    problems = []
    if len(name) > MAX_NAME_LENGTH or not _DNS_1035.match(name):
        problems.append(f"name: got {name!r}; KubeRay needs a DNS-1035 label (lowercase "
                        f"letters, digits and '-', starting with a letter) of at most "
                        f"{MAX_NAME_LENGTH} characters")
    if problem := image_problem(image):
        problems.append(f"image: {problem}")
    if not isinstance(head_cpus, int) or head_cpus < 1:
        problems.append(f"head_cpus: got {head_cpus!r}; need a whole number >= 1 (the router "
                        "and the rollout controller run on the head)")
    if not isinstance(spare_workers, int) or spare_workers < 0:
        problems.append(f"spare_workers: got {spare_workers!r}; need a whole number >= 0")
    return problems


def _group_spec(g: WorkerGroup, image: str, env: list[dict[str, str]], fleet: Fleet,
                name: str) -> dict[str, Any]:
    params: dict[str, str] = {}
    limits = {"cpu": str(g.cpus), "memory": format_quantity(g.memory)}
    if g.gpus:
        params["num-gpus"] = str(g.gpus)
        limits["nvidia.com/gpu"] = str(g.gpus)
    resources = dict(g.resources)
    if g.accelerator_type:  # Ray detects it on the pod; the autoscaler needs it said here
        resources[ACCELERATOR_RESOURCE.format(g.accelerator_type)] = 1
    if resources:
        # KubeRay's documented form: the JSON with its quotes escaped, inside double quotes,
        # e.g. '"{\"mesh_engine\": 1}"' (the backslashes are characters of the value).
        params["resources"] = '"' + json.dumps(whole(resources)).replace('"', '\\"') + '"'
    pod = worker_pod_additions(fleet, name=name, gpus=g.gpus,
                               accelerator_type=g.accelerator_type)
    container = {
        "name": "ray-worker",
        "image": image,
        "env": [dict(e) for e in env] + pod.pop("env"),
        "envFrom": pod.pop("envFrom"),
        "resources": {"requests": dict(limits), "limits": dict(limits)},
        "ports": [{"containerPort": METRICS_PORT, "name": "metrics"}],
        "volumeMounts": pod.pop("volumeMounts"),
    }
    return {
        "groupName": g.name,
        "replicas": g.replicas,
        "minReplicas": g.min_replicas,
        "maxReplicas": g.max_replicas,
        "rayStartParams": params,
        "template": {"spec": {**pod, "containers": [container]}},
    }


class _Literal(str):
    """A string dumped as a YAML literal block (``|``)."""


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no anchors/aliases (a config's ``&engine`` / ``*engine`` is written out)."""

    def ignore_aliases(self, data):
        return True


_Dumper.add_representer(
    _Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))
