"""What a Kubernetes fleet adds to the pods of ``meshctl kuberay``'s manifest: the fleet
file (``meshctl kuberay CONFIG --overlay fleet.yaml``), merged into every manifest the
command writes, so nothing is edited by hand and a regenerated manifest keeps it all.

A fleet file (every field optional; unknown fields are refused)::

    secrets: [model-mesh-credentials]   # Kubernetes Secrets: each key -> an env variable
    secret_env:                         # one variable from one key of a Secret
      HF_TOKEN: {secret: hf, key: token}
    env: {HF_HUB_ENABLE_HF_TRANSFER: "0"}   # plain variables
    service_account: model-mesh         # e.g. one with an IAM role for the bucket
    cache:                              # the node cache: any Kubernetes volume source
      hostPath: {path: /var/cache/model-mesh, type: DirectoryOrCreate}
    workers:                            # every engine pod
      node_selector: {pool: gpu}
      tolerations: [{key: dedicated, operator: Equal, value: llm, effect: NoSchedule}]
    head: {node_selector: {pool: system}}
    accelerators:                       # the pods of variants with that accelerator_type
      H100:
        node_selector: {nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}

What goes where (:func:`worker_pod_additions`, :func:`head_pod_additions`):

- the **engine pods** (the worker groups, which fetch weights and adapters) get the
  secrets as ``envFrom`` (``secretRef``) and ``env`` (``secretKeyRef``), the plain ``env``,
  the service account, and the **cache** volume mounted at :data:`CACHE_PATH`, with
  ``MESH_CACHE_DIR`` there and ``HF_HOME`` in it. Without a fleet file: ``envFrom`` the
  Secret ``<name>-credentials`` marked ``optional`` (a cluster without it starts the same),
  and an ``emptyDir`` cache (kept while the pod lives; a ``hostPath`` or a
  ``persistentVolumeClaim`` keeps it across pods);
- a GPU group's pods tolerate the ``nvidia.com/gpu`` taint GPU node pools carry (GKE, AKS,
  the NVIDIA GPU operator's docs), then ``workers`` and the group's ``accelerators`` entry
  add their node selectors and tolerations;
- the head pod gets ``head``'s.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from serve_app.common.errors import format_validation_error
from serve_app.common.policies import Strict

#: Where the node cache is mounted on an engine pod; ``MESH_CACHE_DIR`` points here.
CACHE_PATH = "/var/cache/model-mesh"
#: The cache volume's name in the pod template.
CACHE_VOLUME = "model-cache"
#: The taint GPU node pools carry, which every GPU pod tolerates.
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
#: The Secret an engine pod reads its credentials from when no fleet file names one.
DEFAULT_SECRET = "{name}-credentials"
#: Kubernetes volume sources a cache may be.
VOLUME_SOURCES = ("hostPath", "persistentVolumeClaim", "emptyDir", "ephemeral", "nfs", "csi",
                  "azureFile", "cephfs", "glusterfs", "iscsi")
_DNS_1123 = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
#: Variables the mesh sets on every pod (its Serve settings, the cache): a fleet file may
#: not set them again.
_RESERVED_ENV = ("MESH_CACHE_DIR", "HF_HOME")


class Toleration(Strict):
    """A Kubernetes toleration, by its own field names."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    tolerationSeconds: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _key_or_exists(self) -> "Toleration":
        if self.key is None and self.operator != "Exists":
            raise ValueError("a toleration without a key tolerates every taint and needs "
                             "operator: Exists; give the taint's key")
        if self.operator == "Exists" and self.value is not None:
            raise ValueError("operator Exists takes no value; use operator: Equal")
        return self


class Placement(Strict):
    """Where a set of pods may run: ``node_selector`` (labels a node must have) and
    ``tolerations`` (taints it may have)."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)


class SecretKey(Strict):
    """One key of a Kubernetes Secret."""

    secret: str
    key: str

    @field_validator("secret")
    @classmethod
    def _name(cls, v: str) -> str:
        return _secret_name(v)


class Fleet(Strict):
    """A fleet file (see the module docstring)."""

    secrets: list[str] | None = None
    secret_env: dict[str, SecretKey] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    service_account: str | None = None
    cache: dict[str, Any] | None = None
    workers: Placement = Field(default_factory=Placement)
    head: Placement = Field(default_factory=Placement)
    accelerators: dict[str, Placement] = Field(default_factory=dict)

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            _secret_name(name)
        return v

    @field_validator("secret_env", "env")
    @classmethod
    def _env_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not _ENV_NAME.match(name):
                raise ValueError(f"{name!r} is not an environment variable name (letters, "
                                 "digits, '_', '-', '.', not starting with a digit)")
            if name in _RESERVED_ENV:
                raise ValueError(f"{name} is the mesh's: it points at the cache volume "
                                 f"({CACHE_PATH}); give the volume as `cache` instead")
        return v

    @field_validator("service_account")
    @classmethod
    def _account(cls, v: str | None) -> str | None:
        if v is not None and not _DNS_1123.match(v):
            raise ValueError(f"{v!r} is not a Kubernetes name (lowercase letters, digits, "
                             "'-' and '.')")
        return v

    @field_validator("cache")
    @classmethod
    def _volume_source(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is None:
            return v
        if len(v) != 1 or next(iter(v)) not in VOLUME_SOURCES \
                or not isinstance(next(iter(v.values())), dict):
            raise ValueError(f"got {v!r}; give one Kubernetes volume source, e.g. "
                             "{hostPath: {path: /var/cache/model-mesh, type: "
                             "DirectoryOrCreate}} or {persistentVolumeClaim: {claimName: "
                             f"model-cache}} (one of {', '.join(VOLUME_SOURCES)})")
        return v

    @field_validator("accelerators")
    @classmethod
    def _known_types(cls, v: dict[str, Placement]) -> dict[str, Placement]:
        from serve_app.common.config import gpu_accelerator_types

        for kind in v:
            if kind not in gpu_accelerator_types():
                raise ValueError(f"{kind!r} is not an accelerator_type Ray knows; use the "
                                 "names variants give in args.accelerator_type ("
                                 f"{', '.join(gpu_accelerator_types())})")
        return v


def _secret_name(name: str) -> str:
    if not _DNS_1123.match(name) or len(name) > 253:
        raise ValueError(f"{name!r} is not a Kubernetes Secret name (lowercase letters, "
                         "digits, '-' and '.')")
    return name


def load_fleet(data: Any) -> Fleet:
    """A fleet file's content (parsed YAML; None: an empty file) as a :class:`Fleet`.

    Raises:
        ValueError: one line per bad field, ``overlay.<field>: <problem>``.
    """
    try:
        return Fleet.model_validate(data or {})
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "overlay", data)) from None


def worker_pod_additions(fleet: Fleet, *, name: str, gpus: int,
                         accelerator_type: str | None) -> dict[str, Any]:
    """What an engine pod of a group with ``gpus`` GPUs per pod and ``accelerator_type``
    gets: ``env``, ``envFrom``, ``volumes``, ``volumeMounts``, ``nodeSelector``,
    ``tolerations``, ``serviceAccountName`` (the keys that apply). ``name``: the
    RayService's, for the default Secret."""
    env = [{"name": "MESH_CACHE_DIR", "value": CACHE_PATH},
           {"name": "HF_HOME", "value": f"{CACHE_PATH}/huggingface"}]
    env += [{"name": k, "value": v} for k, v in fleet.env.items()]
    env += [{"name": k, "valueFrom": {"secretKeyRef": {"name": s.secret, "key": s.key}}}
            for k, s in fleet.secret_env.items()]
    if fleet.secrets is None:
        env_from = [{"secretRef": {"name": DEFAULT_SECRET.format(name=name),
                                   "optional": True}}]
    else:
        env_from = [{"secretRef": {"name": s}} for s in fleet.secrets]
    placement = _merge([fleet.workers, fleet.accelerators.get(accelerator_type or "")])
    tolerations = ([dict(GPU_TOLERATION)] if gpus else []) + placement["tolerations"]
    out: dict[str, Any] = {
        "env": env,
        "envFrom": env_from,
        "volumes": [{"name": CACHE_VOLUME, **(fleet.cache or {"emptyDir": {}})}],
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_PATH}],
    }
    if placement["nodeSelector"]:
        out["nodeSelector"] = placement["nodeSelector"]
    if tolerations:
        out["tolerations"] = _unique(tolerations)
    if fleet.service_account:
        out["serviceAccountName"] = fleet.service_account
    return out


def head_pod_additions(fleet: Fleet) -> dict[str, Any]:
    """What the head pod gets: ``nodeSelector`` and ``tolerations`` from ``head``."""
    placement = _merge([fleet.head])
    out: dict[str, Any] = {}
    if placement["nodeSelector"]:
        out["nodeSelector"] = placement["nodeSelector"]
    if placement["tolerations"]:
        out["tolerations"] = placement["tolerations"]
    return out


def _merge(placements: list[Placement | None]) -> dict[str, Any]:
    selector: dict[str, str] = {}
    tolerations: list[dict[str, Any]] = []
    for p in placements:
        if p is None:
            continue
        selector.update(p.node_selector)
        tolerations += [t.model_dump(exclude_none=True) for t in p.tolerations]
    return {"nodeSelector": selector, "tolerations": _unique(tolerations)}


def _unique(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
