"""Serve latency benchmark: the HTTP endpoint against the Renderer called in-process.

    python benchmarks/serve_latency.py [--models DIR] [--rounds 40] [--out result.json]
    python benchmarks/serve_latency.py --smoke     # every section at the smallest counts (the tests run it)

With the tiny models on a CPU (made in a temporary folder unless --models is given), one local
Serve with one CPU replica (one torch thread) and, in the benchmark process, a Renderer on the
same files and threads. It measures (medians; see benchmarks/common.py for the timing rules):
- low load, interleaved round by round: one request through HTTP (JSON answer) against
  Renderer.render + PNG encoding in-process (the server does both). The Serve overhead is the
  median of the per-round differences, and also, per HTTP request, the latency minus the
  replica's own work timings (text, sample, decode, png, encode). Once with the default (no batch
  window) and once with a 10 ms window (`batch_wait_timeout_s=0.01`, the old default), which a lone
  request waits in full. Beside it, GET /v1/health: the front -> ingress -> client round trip with
  no work at all, i.e. Serve's own floor on this machine.
- concurrency (4 clients): requests/s, latency, mean batch size;
- cache: a reference already on the replica (hit) against one it must encode (miss);
- overload: a burst against max_ongoing_requests=1, max_queued_requests=1: how fast 503s return;
- Serve's floor: a no-op app answering a PNG-sized body (160 kB) from the replica the front calls
  (one hop, what a merged ingress + renderer would pay) and through a second deployment behind it
  (two hops, the ingress -> renderer layout this server has): what Serve itself costs here.
The server's front door is HAProxy with direct ingress when haproxy is installed (the default,
`--front haproxy`), or Serve's own HTTP proxy (`--front serve_proxy`, the layout before direct
ingress). Behind it the ingress renders itself (`--topology fused`, the default for one renderer
replica) or calls a renderer deployment (`--topology split`, one hop more). Run them side by side
for a before/after, e.g. `--topology split --out before.json` and `--out after.json`. The JSON's
`front` and `topology` say which ran.
Prints one JSON object (and writes it to --out if given). Called in a process that already runs a
local Serve (`serve_app.start_local_serve`), it deploys its applications there in turn and leaves
that Serve running; otherwise it starts its own and stops it at the end.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.error import HTTPError
from urllib.request import Request, urlopen

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
# Ray gives each worker OMP_NUM_THREADS=1; the in-process baseline must run under the same threading.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from benchmarks.common import emit, environment, interleaved, log

SMALL = {"width": 256, "height": 256, "steps": 2}
COMPUTE = ("text_s", "sample_s", "decode_s", "png_s", "encode_s")  # replica timings that are the work itself
CPU = torch.device("cpu")


def _ms(seconds: list[float]) -> dict:
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"n": len(ordered), "p50_ms": statistics.median(ordered) * 1e3, "p95_ms": p95 * 1e3}


class InProcess:
    """The Renderer alone, as a replica holds it: one resident model, a RefKV encoded once."""

    def __init__(self, models: Path, reference: bytes) -> None:
        from snapref_ray.engine import Renderer
        from snapref_ray.requests import RenderRequest, RenderSettings
        from snapref_ray.storage.image_files import encode_image

        torch.set_num_threads(1)
        self._renderer = Renderer.from_folder(models, device="cpu")
        self._refkv = self._renderer.encode_reference([reference], width=256, height=256)
        self._request = RenderRequest(prompt="1girl, in a cafe", seed=0, settings=RenderSettings(**SMALL))
        self._encode_image = encode_image
        self.reference = reference

    def __call__(self) -> None:
        (result,) = self._renderer.render([self._request], refkv=self._refkv)
        self._encode_image(result.image, "png", parameters="p", info={"seed": 0})

    def encode(self, caption: str) -> None:
        self._renderer.encode_reference([self.reference], ref_caption=caption, width=256, height=256)


# Counts per section: (low-load rounds, warm-up rounds, cache rounds, overload burst, overload steps).
FULL = {"warmup": 3, "cache_rounds": 8, "burst": 16, "overload_steps": 60}
# The smoke checks every section runs: a burst of two-step renders still fills the queue it sends to.
SMOKE = {"rounds": 3, "warmup": 1, "cache_rounds": 1, "burst": 4, "overload_steps": 2}
# Every field the README's table reads; the smoke test checks they are all there.
FIELDS = (
    "front",
    "topology",
    "low_load",
    "concurrent",
    "cache",
    "low_load_10ms_batch_window",
    "overload",
    "serve_floor",
    "environment",
)
PNG_BYTES = 160_000  # a 256x256 PNG of the tiny model, as the low-load requests return


def low_load(client, ref: str, local: InProcess, rounds: int, warmup: int = 3) -> dict:
    overhead: list[float] = []

    def http() -> None:
        t0 = time.perf_counter()
        answer = client.render("1girl, in a cafe", reference_id=ref, response_format="json", **SMALL)
        # Everything that is not the render's own work: HTTP, proxy, ingress, routing, batch window.
        overhead.append(time.perf_counter() - t0 - sum(answer["timings"][k] for k in COMPUTE))

    def health() -> None:
        with urlopen(client.base_url + "/v1/health", timeout=60) as r:
            r.read()

    times = interleaved({"http": http, "in_process": local, "health": health}, CPU, rounds=rounds, warmup_rounds=warmup)
    overhead = overhead[-rounds:]  # drop the warm-up rounds
    return {
        "http": {**_ms(times["http"]), "requests_per_s": len(times["http"]) / sum(times["http"])},
        "health_floor": _ms(times["health"]),
        "in_process": {
            **_ms(times["in_process"]),
            "requests_per_s": len(times["in_process"]) / sum(times["in_process"]),
        },
        "overhead_vs_in_process_p50_ms": statistics.median(a - b for a, b in zip(times["http"], times["in_process"]))
        * 1e3,
        "overhead_measured_p50_ms": statistics.median(overhead) * 1e3,
        "overhead_measured": _ms(overhead),
    }


def concurrent(client, ref: str, requests: int, clients: int = 4) -> dict:
    latencies, batch_sizes = [], []
    lock = threading.Lock()

    def one(i: int) -> None:
        t0 = time.perf_counter()
        answer = client.render(f"1girl, scene {i}", reference_id=ref, seed=i, response_format="json", **SMALL)
        with lock:
            latencies.append(time.perf_counter() - t0)
            batch_sizes.append(answer["batch_size"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    return {
        **_ms(latencies),
        "clients": clients,
        "requests_per_s": requests / (time.perf_counter() - t0),
        "mean_batch_size": statistics.fmean(batch_sizes),
        "max_batch": max(batch_sizes),
    }


def cache(client, local: InProcess, rounds: int = 8) -> dict:
    miss, hit, encode, in_process_encode = [], [], [], []
    for i in range(rounds):
        caption = f"benchmark caption {i} {time.time()}"  # a new caption is a new K/V: nothing holds it yet
        ref = client.upload_reference(local.reference, ref_caption=caption)
        for expect_hit, into in ((False, miss), (True, hit)):
            t0 = time.perf_counter()
            answer = client.render("1girl", reference_id=ref, response_format="json", **SMALL)
            into.append(time.perf_counter() - t0)
            assert answer["cache_hit"] is expect_hit, answer["cache_hit"]
            if not expect_hit:
                encode.append(answer["timings"]["encode_s"])
        t0 = time.perf_counter()
        local.encode(caption)
        in_process_encode.append(time.perf_counter() - t0)
    return {
        "miss": _ms(miss),
        "hit": _ms(hit),
        "replica_encode": _ms(encode),
        "in_process_encode": _ms(in_process_encode),
        "miss_minus_hit_p50_ms": (statistics.median(miss) - statistics.median(hit)) * 1e3,
    }


def overload(url: str, ref: str, burst: int = 16, steps: int = 60) -> dict:
    barrier = threading.Barrier(burst)
    body = {"prompt": "1girl", "reference_id": ref, "width": 512, "height": 512, "steps": steps}

    def one(seed: int) -> tuple[int, float]:
        data = json.dumps({**body, "seed": seed}).encode()
        barrier.wait(timeout=30)
        t0 = time.perf_counter()
        try:
            with urlopen(Request(url + "/v1/render", data, {"Content-Type": "application/json"}), timeout=300) as r:
                r.read()
                return r.status, time.perf_counter() - t0
        except HTTPError as e:
            e.read()
            return e.code, time.perf_counter() - t0

    with ThreadPoolExecutor(burst) as pool:
        results = list(pool.map(one, range(burst)))
    rejected = [s for code, s in results if code == 503]
    admitted = [s for code, s in results if code == 200]
    return {
        "burst": burst,
        "ok": len(admitted),
        "rejected_503": len(rejected),
        "latency_503": _ms(rejected) if rejected else None,
        "latency_200": _ms(admitted) if admitted else None,
    }


def serve_floor(url: str, rounds: int) -> dict:
    """HTTP latency of no-op Serve apps: proxy -> replica (one hop) and proxy -> replica -> replica (two)."""
    from ray import serve
    from starlette.responses import Response

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Payload:
        async def get(self, n: int) -> bytes:
            return b"x" * n

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Front:
        def __init__(self, behind=None) -> None:
            from snapref_ray.serve.direct_ingress import over_this_replicas_transport

            # The server's own transport between deployments (gRPC behind HAProxy, actor calls otherwise).
            self._behind = None if behind is None else over_this_replicas_transport(behind)

        async def __call__(self, request) -> Response:
            n = int(request.query_params.get("bytes", "0"))
            body = b"x" * n if self._behind is None else await self._behind.get.remote(n)
            return Response(body, media_type="application/octet-stream")

    result = {"payload_bytes": PNG_BYTES}
    for name, app in (("one_hop", Front.bind()), ("two_hops", Front.bind(Payload.bind()))):
        serve.run(app, name=f"floor-{name}", route_prefix=f"/floor-{name}")

    def get(name: str) -> None:
        with urlopen(f"{url}/floor-{name}?bytes={PNG_BYTES}", timeout=60) as r:
            r.read()

    times = interleaved(
        {name: functools.partial(get, name) for name in ("one_hop", "two_hops")}, CPU, rounds=rounds, warmup_rounds=3
    )
    for name in ("one_hop", "two_hops"):
        result[name] = _ms(times[name])
        serve.delete(f"floor-{name}")
    return result


def _running_serve_port() -> int | None:
    """The HTTP port of the Serve this process already drives (Ray connected, Serve started), else None."""
    import ray

    if not ray.is_initialized():
        return None
    from ray.serve.context import _get_global_client
    from ray.serve.exceptions import RayServeException

    try:
        return _get_global_client().http_config.port
    except RayServeException:
        return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="model folder with reference.png (default: a tiny set in a temporary folder)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--smoke", action="store_true", help="every section once at the smallest counts (CI)")
    parser.add_argument(
        "--front",
        choices=("haproxy", "serve_proxy"),
        default="haproxy",
        help="HAProxy + direct ingress (the server's default; needs haproxy installed) or Serve's proxy",
    )
    parser.add_argument(
        "--topology",
        choices=("fused", "split"),
        default="fused",
        help="the ingress renders itself (the default for one renderer replica) or calls a renderer"
        " deployment (the layout for several replicas, one hop more)",
    )
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    counts = {**FULL, "rounds": args.rounds}
    if args.smoke:
        counts = SMOKE

    from ray import serve

    from snapref_ray.client import SnapRefClient
    from snapref_ray.pipelines.serve_app import (
        APP_NAME,
        build_app,
        deploy_local,
        http_front,
        start_local_serve,
        stop_local,
    )
    from snapref_ray.serve.config import ServeConfig, ServeLimits
    from snapref_ray.serve.direct_ingress import free_port
    from snapref_ray.tiny import make_tiny

    # Ray prints to fd 1 (worker logs, shutdown notices) from threads and child processes: send fd 1 to
    # stderr while Ray runs, so stdout carries only the JSON.
    saved_stdout = os.dup(1)
    sys.stdout.flush()
    os.dup2(2, 1)
    tmp = tempfile.TemporaryDirectory()
    models = Path(args.models) if args.models else make_tiny(Path(tmp.name) / "tiny")
    result: dict = {"model": str(models) if args.models else "tiny", "size": SMALL, "smoke": args.smoke}
    running_port = _running_serve_port()  # a caller's Serve (the tests' session) is reused, not restarted
    base = ServeConfig(
        model=str(models),
        port=running_port or free_port(),
        min_replicas=1,
        max_replicas=1,
        cpus_per_replica=1,
        direct_ingress=args.front == "haproxy",
        topology=args.topology,
    )
    result["topology"] = args.topology
    log(f"starting Serve ({args.front}, {args.topology})")
    if running_port is None:
        # Replica logs stay in Ray's log files, so stdout holds only the JSON.
        url = start_local_serve(base, num_cpus=6, log_to_driver=False)
    else:
        url = f"http://{base.host}:{running_port}"
    deploy_local(base)
    try:
        result["front"] = http_front()
        if result["front"] != args.front:
            raise SystemExit(
                f"asked for --front {args.front}, but the server runs {result['front']} (is haproxy installed?)"
            )
        local = InProcess(models, (models / "reference.png").read_bytes())
        client = SnapRefClient(url, timeout=300)
        ref = client.upload_reference(local.reference)
        log("low load, default (no batch window)")
        result["low_load"] = {
            "batch_wait_timeout_s": base.batch_wait_timeout_s,
            **low_load(client, ref, local, counts["rounds"], counts["warmup"]),
        }
        log("concurrency")
        result["concurrent"] = concurrent(client, ref, counts["rounds"])
        log("cache hit / miss")
        result["cache"] = cache(client, local, counts["cache_rounds"])

        serve.run(build_app(base.model_copy(update={"batch_wait_timeout_s": 0.01})), name=APP_NAME, route_prefix="/")
        ref = client.upload_reference(local.reference)
        log("low load, 10 ms batch window")
        result["low_load_10ms_batch_window"] = low_load(client, ref, local, counts["rounds"], counts["warmup"])

        tight = base.model_copy(
            update={
                "max_ongoing_requests": 1,
                "max_queued_requests": 1,
                "max_batch": 1,
                "batch_wait_timeout_s": 0.0,
                "limits": ServeLimits(max_n=1, max_side=512),
            }
        )
        serve.run(build_app(tight), name=APP_NAME, route_prefix="/")
        ref = client.upload_reference(local.reference)
        client.render("warm-up", reference_id=ref, **SMALL)
        log("overload burst")
        result["overload"] = {
            "max_ongoing_requests": 1,
            "max_queued_requests": 1,
            **overload(url, ref, counts["burst"], counts["overload_steps"]),
        }
        log("Serve's floor: no-op apps, one and two hops")
        result["serve_floor"] = serve_floor(url, 2 * counts["rounds"])
        result["environment"] = environment(CPU, torch.float32)
    finally:
        if running_port is None:
            stop_local(drain=False)
        else:
            serve.delete(APP_NAME)  # the caller's Serve stays as it was
        tmp.cleanup()
        sys.stdout.flush()
        os.dup2(saved_stdout, 1)
    printed = emit(result, indent=2)
    if args.out:
        Path(args.out).write_text(json.dumps(printed, indent=2) + "\n")  # the figures as printed
    return printed


if __name__ == "__main__":
    main()
