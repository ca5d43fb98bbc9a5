"""``meshctl kuberay``: a Serve config as a KubeRay ``RayService`` manifest
(:mod:`serve_app.release.kuberay`), printed or written to a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from serve_app.commands.base import REFUSED_EXIT, UsageError, read_config, read_yaml
from serve_app.common.serve_env import DEFAULT_INGRESS, INGRESSES
from serve_app.release import kuberay


def kuberay_command(args: argparse.Namespace) -> int:
    """``meshctl kuberay``: 0 the manifest printed or written, 1 the config cannot make one
    (each problem on stderr, nothing written).

    Raises:
        UsageError: the config or the fleet file cannot be read; ``-o`` cannot be written.
    """
    config = read_config(args.config)
    overlay = read_yaml(args.overlay) if args.overlay else None
    try:
        manifest = kuberay.rayservice_manifest(
            config, name=args.name, image=args.image, namespace=args.namespace,
            head_cpus=args.head_cpus, head_memory=args.head_memory,
            worker_memory=args.worker_memory, spare_workers=args.spare_workers,
            ingress=args.ingress, overlay=overlay)
    except kuberay.ManifestError as e:
        print(f"{args.config}: INVALID (no manifest written)", file=sys.stderr)
        for p in e.problems:
            print(f"  {p}", file=sys.stderr)
        return REFUSED_EXIT
    for w in kuberay.manifest_warnings(config, manifest, overlay=overlay,
                                       worker_memory=args.worker_memory):
        print(f"{args.config}: WARNING {w}", file=sys.stderr)
    source = args.config + (f" --overlay {args.overlay}" if args.overlay else "")
    text = kuberay.manifest_yaml(manifest, source=source, sizing=kuberay.pod_sizing(
        config, worker_memory=args.worker_memory))
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as e:
            raise UsageError(f"cannot write {args.output}: {e.strerror or e}") from None
        groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
        print(f"wrote {args.output}: RayService {args.name}, worker groups "
              + (", ".join(f"{g['groupName']} ({g['replicas']} pods of "
                           + _pod_figures(g) + ")" for g in groups) or "none"))
    else:
        sys.stdout.write(text)
    return 0


def _pod_figures(group: dict[str, Any]) -> str:
    """``4 CPUs, 30Gi, 2 GPUs``: a worker group's pod limits."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return (f"{limits['cpu']} CPUs, {limits['memory']}"
            + (f", {limits['nvidia.com/gpu']} GPUs" if "nvidia.com/gpu" in limits else ""))


def add_kuberay(sub) -> None:
    """Add ``kuberay`` to meshctl's subcommands (``sub``: argparse's subparsers)."""
    p = sub.add_parser("kuberay", help="KubeRay RayService manifest of a Serve config")
    p.add_argument("config")
    p.add_argument("-o", "--output", metavar="FILE", help="write here (default: stdout)")
    p.add_argument("--name", default=kuberay.DEFAULT_NAME,
                   help="the RayService's name (default %(default)s)")
    p.add_argument("--namespace", metavar="NS", help="metadata.namespace (default: kubectl's)")
    p.add_argument("--image", default=kuberay.DEFAULT_IMAGE,
                   help="image of every pod, built from deploy/kuberay/Dockerfile "
                        "(default %(default)s)")
    p.add_argument("--head-cpus", type=int, metavar="N", default=kuberay.DEFAULT_HEAD_CPUS,
                   help="CPUs of the head pod: router, rollout controller, Serve controller "
                        "(default %(default)s)")
    p.add_argument("--head-memory", metavar="Q", default=kuberay.DEFAULT_HEAD_MEMORY,
                   help="memory of the head pod (default %(default)s)")
    p.add_argument("--worker-memory", metavar="Q", default=kuberay.DEFAULT_WORKER_MEMORY,
                   help="memory of an engine's pod when its ray_actor_options has no memory "
                        "(default %(default)s)")
    p.add_argument("--spare-workers", type=int, metavar="N", default=0,
                   help="pods a worker group may add past its engines (surge replacements, "
                        "blue/green variants); > 0 turns on the Ray autoscaler (default 0)")
    p.add_argument("--ingress", choices=sorted(INGRESSES),
                   help="how clients reach the router on each pod: Serve's HTTP proxy or "
                        "Ray's HAProxy (default: $MESH_INGRESS, else "
                        f"{DEFAULT_INGRESS}); its Serve settings go in every pod's env")
    p.add_argument("--overlay", metavar="FLEET_FILE",
                   help="the fleet file merged into the pods: secrets, the cache volume, node "
                        "selectors and tolerations, per accelerator type too "
                        "(docs/gpu-fleet.md, \"The fleet file\"); default: an optional "
                        "Secret NAME-credentials and an emptyDir cache")
