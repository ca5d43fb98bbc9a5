"""The command line of ``scripts/bench.py``: one parser, and the benchmark module each mode
runs (``--sim``, ``--sessions``, ``--adapters``, ``--router-throughput``, ``--limits``,
``--direct-ingress``, ``--chaos``; none: the mesh against vLLM's own server)."""

from __future__ import annotations

from pathlib import Path

from bench import mesh_vs_vllm
from bench.script_args import ScriptError, ScriptParser, script_parser

#: ``--sessions`` and ``--adapters`` given without a number: the sizes of their tables in
#: docs/benchmarks.md.
SESSIONS, ADAPTERS = 24, 16


def build_parser(description: str | None, prog: str | None = None) -> ScriptParser:
    """bench.py's options, with ``description`` (the script's docstring) atop ``--help``."""
    parser = script_parser(description, prog=prog)
    parser.add_argument("--mesh-url", default="http://127.0.0.1:8000/v1",
                        help="the running mesh's OpenAI base URL")
    parser.add_argument("--config", default="serve_configs/local.yaml",
                        help="the Serve config the mesh runs (its variant's model and engine "
                        "args start vLLM's own server)")
    parser.add_argument("--variant", help="variant application to mirror (default: the "
                        "config's first)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32],
                        help="requests in flight, one row each (--adapters: the first, 8 "
                        "when not given)")
    parser.add_argument("--requests", type=int,
                        help="requests per round (default 32; --adapters: 48; "
                        "--router-throughput: 600)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="direct and mesh alternate this many times per row; the row "
                        "shows each figure's median and the spread of the tokens/s ratio")
    parser.add_argument("--direct-nice", type=int, default=15,
                        help="niceness of vLLM's own server: 15, as Ray runs the mesh's "
                        "processes (RAY_worker_niceness), so both share the CPU alike with "
                        "the client; 0 to compare with vLLM as it runs by default")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of each request (ignore_eos: each generates them all)")
    parser.add_argument("--api-key", default="sk-mesh-ops-demo",
                        help="key for the base workload (ignored by a mesh in open mode)")
    mix = mesh_vs_vllm.DEMO_MIX
    parser.add_argument("--mix", nargs="?", const=mix, metavar="ADAPTER=KEY,...",
                        help=f"also run the adapter mix (default: {mix})")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--direct-ingress", action="store_true",
                        help="start its own cluster with Ray Serve's direct ingress on "
                        "(RAY_SERVE_ENABLE_DIRECT_INGRESS=1), deploy --config, and measure "
                        "the mesh through the Serve proxy and straight to the router "
                        "replica's own port in the same rounds")
    parser.add_argument("--limits", action="store_true",
                        help="measure what cluster-wide tenant limits add (see above)")
    parser.add_argument("--limit-calls", type=int, default=2000,
                        help="--limits: asks to the shared counts per run")
    parser.add_argument("--sessions", type=int, nargs="?", const=SESSIONS, metavar="N",
                        help="cache-aware replica routing vs Serve's default router on two "
                        f"replicas, N sessions ({SESSIONS} when N is not given; "
                        "bench/sessions.py; starts its own Ray and mesh)")
    parser.add_argument("--turns", type=int, default=4, help="--sessions: turns per session")
    parser.add_argument("--prefix-tokens", type=int, default=1500,
                        help="--sessions: system prompt + document tokens per session")
    parser.add_argument("--in-flight", type=int, default=0,
                        help="--sessions: requests in flight at once (default: every session)")
    parser.add_argument("--tenants", type=int, default=4,
                        help="--sessions: tenants (one system prompt each)")
    parser.add_argument("--workdir", default=".mesh/bench",
                        help="--sessions: where the deployed configs are written")
    parser.add_argument("--adapters", type=int, nargs="?", const=ADAPTERS, metavar="K",
                        help="many LoRA adapters: K registered copies on a 2-replica variant "
                        f"({ADAPTERS} when K is not given), adapter affinity vs Serve's "
                        "default router vs vLLM direct vs base-only, and a merged variant "
                        "(bench/adapters.py; starts its own Ray and mesh)")
    parser.add_argument("--max-resident", type=int, default=4,
                        help="--adapters: max_adapters_per_replica")
    parser.add_argument("--router-throughput", action="store_true",
                        help="the mesh against vLLM's own server on the same simulated engine: "
                        "requests/s, TTFT overhead, CPU per request of every process the mesh "
                        "adds (bench/router_throughput.py; starts its own Ray and mesh; "
                        "--config default tenants.yaml)")
    parser.add_argument("--model", default="smollm", help="--router-throughput: the route")
    parser.add_argument("--ingress", choices=["proxy", "haproxy", "both"],
                        help="--router-throughput: how clients reach the router: Serve's "
                        "HTTP proxy, Ray's HAProxy, or both, one cluster each in the same run "
                        "(default: $MESH_INGRESS, else the mesh's default; "
                        "serve_app/common/serve_env.py)")
    parser.add_argument("--leases", choices=["on", "off", "both"], default="on",
                        help="--router-throughput: the routers' budget leases on the limited "
                        "tenant (the default), off (a ledger ask per request), or both, off "
                        "then on, redeployed in place (default: %(default)s)")
    parser.add_argument("--headroom", type=float, nargs="+",
                        help="--router-throughput: each route's admission.headroom, one run "
                        "per value, redeployed in place (default: the config's own)")
    parser.add_argument("--ttft-requests", type=int, default=100,
                        help="--router-throughput: requests sent one at a time for TTFT")
    parser.add_argument("--profile", action="store_true",
                        help="--router-throughput: then record the router replica with py-spy "
                        "under the same load and print where its CPU goes")
    parser.add_argument("--profile-s", type=float, default=20.0,
                        help="--router-throughput --profile: seconds py-spy records")
    parser.add_argument("--chaos", action="store_true",
                        help="the chaos drill: changes and kills in turn under steady load, "
                        "each window judged (bench/chaos.py; starts its own Ray and mesh)")
    parser.add_argument("--minutes", type=float, default=45.0,
                        help="--chaos: how long the drill runs (default: %(default)s)")
    parser.add_argument("--period", type=float,
                        help="--chaos: seconds between events (default 75 on vLLM, 12 on "
                        "the simulated engine)")
    parser.add_argument("--engine", choices=["vllm", "sim"], default="vllm",
                        help="--chaos: the variants' engine (default: %(default)s)")
    from bench import scale  # --sim's options

    scale.add_arguments(parser)
    return parser


def main(parser: ScriptParser, argv: list[str] | None = None) -> None:
    """Parse ``argv`` (None: the command line) with ``parser`` (:func:`build_parser`) and run
    the benchmark its options choose."""
    a = parser.parse_args(argv)
    if a.chaos:
        from bench import chaos

        return chaos.run(a)
    if a.sim:
        from bench import scale

        return scale.run(a)
    if a.router_throughput:
        from bench import router_throughput

        if a.config == "serve_configs/local.yaml":  # the default of the other modes
            a.config = "serve_configs/tenants.yaml"
        a.requests = a.requests or 600
        a.concurrency = a.concurrency[0] if a.concurrency != [1, 8, 32] else 32
        a.max_tokens = a.max_tokens if a.max_tokens != 64 else 16
        return router_throughput.run(a)
    if not Path(a.config).is_file():
        raise ScriptError(f"--config {a.config}: no such file")
    if a.adapters:
        from bench import adapters
        a.requests = a.requests or 48
        a.concurrency = a.concurrency[0] if a.concurrency != [1, 8, 32] else 8
        return adapters.run(a)
    if a.sessions:
        from bench import sessions

        return sessions.run(a)
    a.requests = a.requests or 32
    targets = mesh_vs_vllm.mesh_targets(a)
    if a.limits:
        from bench import limits

        return limits.run(a)
    return mesh_vs_vllm.run(a, targets)
