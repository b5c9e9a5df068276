"""Benchmark: fetch a RefKV from another node, or encode the reference again?

On two nodes of a real multi-node Ray cluster (by default the fake multi-node cluster of
benchmarks/fake_cluster.py, started here; or `--address` of a running one), side by side in one run:

- fetch: an actor on node A returns a RefKV of the real shape with random bf16 values (so the
  driver owns it, as in a job); an actor on node B `ray.get`s it, which pulls every byte from A's
  object store into B's over the network (loopback on one machine). A fresh object every round,
  so each fetch is a real transfer and never a local hit.
- encode: the same actor on node B runs the engine's reference stream
  (`Renderer._run_reference_stream`, via benchmarks/snapref_steps.StepBench) on a 1 MP reference
  (1024x1024 px, 4,096 tokens) at the real DiT width. On a CPU only `--encode-blocks` of the 28
  blocks are run, and the figure is scaled by 28 / blocks (the reference stream's cost is the same
  for every block; embedders and the text path are not part of it).

Printed as one JSON record: the RefKV's shape and bytes, fetch and encode medians, the measured
bandwidth, and for 10 / 25 / 100 Gbit/s the transfer time of this RefKV (= the break-even encode
time: re-encoding wins when it encodes faster than that) with the decision the job scheduler
(`snapref_ray.cluster.placement.fetch_is_cheaper`) takes against the encode time measured here.

    python -m benchmarks.cross_node_transfer            # real size (0.94 GB RefKV), ~5 min on 2 cores
    python -m benchmarks.cross_node_transfer --smoke    # tiny, every code path
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import ray

from benchmarks.common import REAL, SMOKE, emit, environment, log, summarize
from snapref_ray.cluster.placement import fetch_is_cheaper
from snapref_ray.models.geometry import token_count

# The DiT's K/V layout (snapref_ray/adapter/refkv.py: [blocks, K/V, heads, ref_tokens, head_dim]).
REAL_BLOCKS, REAL_HEADS, REAL_HEAD_DIM = REAL.num_blocks, REAL.model_channels // REAL.head_dim, REAL.head_dim
REAL_REF_PX = (1024, 1024)  # 1 MP reference: 64 x 64 = 4,096 tokens
LINK_GBPS = (10.0, 25.0, 100.0)

FIELDS = (
    "benchmark",
    "refkv_shape",
    "refkv_bytes",
    "fetch",
    "encode",
    "measured_gbps",
    "break_even",
    "nodes",
    "environment",
)
BREAK_EVEN_FIELDS = ("gbps", "transfer_seconds", "encode_seconds", "choice")


# A node may go away under an actor on an autoscaling cluster: restart it, retry the call.
@ray.remote(num_gpus=1, num_cpus=1, max_restarts=2, max_task_retries=2)
class Holder:
    """Node A: makes RefKVs of a given shape with random values; the caller owns what it returns."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def make(self, shape: tuple[int, ...], seed: int):
        import torch

        from snapref_ray.adapter.refkv import RefKV

        gen = torch.Generator().manual_seed(seed)
        kv = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        tokens = shape[3]
        side = int(tokens**0.5)
        return RefKV(kv, ((1, side, side),), ((0, 0, 0),), (1, side, side), "benchmark-adapter", f"ref-{seed}")


@ray.remote(num_gpus=1, num_cpus=1, max_restarts=2, max_task_retries=2)
class Reader:
    """Node B: fetches RefKVs from the object store and runs the reference stream."""

    def __init__(self, smoke: bool, encode_blocks: int, threads: int) -> None:
        import torch

        from benchmarks.snapref_steps import GEOMETRIES, StepsGeometry

        torch.set_num_threads(threads)
        if smoke:
            geo = GEOMETRIES["smoke"]
        else:
            geo = StepsGeometry(REAL.with_blocks(encode_blocks), *REAL_REF_PX, ref_rank=128, target_rank=64)
        self.geo = geo
        t0 = time.perf_counter()
        from benchmarks.snapref_steps import StepBench

        self.bench = StepBench(geo, torch.device("cpu"), torch.float32)  # encodes once: the warm-up
        self.build_s = time.perf_counter() - t0

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def fetch(self, wrapped: list) -> dict[str, Any]:
        t0 = time.perf_counter()
        kv = ray.get(wrapped[0], timeout=600)
        seconds = time.perf_counter() - t0
        checksum = float(kv.kv_N2HLD[-1, -1, -1, -1, :8].float().sum())  # the last bytes are really here
        return {"seconds": seconds, "nbytes": kv.nbytes, "checksum": checksum}

    def encode(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        kv = self.bench.encode()
        return {
            "seconds": time.perf_counter() - t0,
            "blocks": kv.num_blocks,
            "tokens": kv.num_tokens,
            "heads": kv.kv_N2HLD.shape[2],
            "head_dim": kv.kv_N2HLD.shape[4],
        }


def refkv_shape(smoke: bool) -> tuple[int, int, int, int, int]:
    if smoke:
        g = SMOKE
        # 1,024 tokens: 512 KB, above Ray's 100 KB inline limit, so it travels between object stores too.
        return (g.num_blocks, 2, g.model_channels // g.head_dim, 1024, g.head_dim)
    tokens = token_count(height=REAL_REF_PX[1], width=REAL_REF_PX[0])
    return (REAL_BLOCKS, 2, REAL_HEADS, tokens, REAL_HEAD_DIM)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    shape = refkv_shape(args.smoke)
    holder, reader = Holder.remote(), Reader.remote(args.smoke, args.encode_blocks, args.encode_threads)
    node_a, node_b = ray.get([holder.node.remote(), reader.node.remote()], timeout=600)
    if node_a == node_b:
        raise SystemExit("holder and reader landed on one node: the cluster needs two nodes with GPU: 1 each")
    log(f"holder on {node_a[-8:]}, reader on {node_b[-8:]}; RefKV {shape}")
    fetches, encodes, nbytes = [], [], 0
    encode_info: dict[str, Any] = {}
    for r in range(args.rounds):
        ref = holder.make.remote(shape, r)
        ray.wait([ref], timeout=600, fetch_local=False)  # made and stored on A before the clock starts
        fetched = ray.get(reader.fetch.remote([ref]), timeout=900)
        del ref  # the driver owned it: dropping it frees both copies before the next round
        fetches.append(fetched["seconds"])
        nbytes = fetched["nbytes"]
        encode_info = ray.get(reader.encode.remote(), timeout=1800)
        encodes.append(encode_info["seconds"])
        log(
            f"round {r}: fetch {fetched['seconds']:.3f} s, encode ({encode_info['blocks']} blocks) "
            f"{encode_info['seconds']:.3f} s"
        )
    scale = shape[0] / encode_info["blocks"]  # smoke: the tiny DiT encodes every one of its blocks
    encode_s = statistics.median(encodes) * scale
    fetch_s = statistics.median(fetches)
    measured_bps = nbytes / fetch_s
    break_even = []
    for gbps in (*LINK_GBPS, 8 * measured_bps / 1e9):
        transfer_s = nbytes * 8 / (gbps * 1e9)
        choice = "fetch" if fetch_is_cheaper(nbytes, gbps * 1e9 / 8, encode_s) else "re-encode"
        break_even.append({"gbps": gbps, "transfer_seconds": transfer_s, "encode_seconds": encode_s, "choice": choice})
    import torch

    return {
        "benchmark": "cross_node_transfer",
        "smoke": args.smoke,
        "refkv_shape": list(shape),
        "refkv_bytes": nbytes,
        "fetch": summarize(fetches),
        "encode": {
            **summarize(encodes),
            "blocks_run": encode_info["blocks"],
            "blocks_real": shape[0],
            "scaled_median_s": encode_s,
            "ref_tokens": encode_info["tokens"],
            "threads": args.encode_threads,
            "device": "cpu",
            "dtype": "float32",
        },
        "measured_gbps": 8 * measured_bps / 1e9,
        "break_even": break_even,
        "nodes": {"holder": node_a, "reader": node_b},
        "environment": environment(torch.device("cpu"), torch.float32),
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny RefKV and DiT: checks every code path in seconds")
    p.add_argument("--address", help="a running cluster with two nodes offering GPU: 1 (default: start the fake one)")
    p.add_argument("--rounds", type=int, default=None, help="fetch + encode rounds (default 3, smoke 1)")
    p.add_argument(
        "--encode-blocks", type=int, default=1, help="real-width blocks the CPU encode runs (scaled to 28); default 1"
    )
    p.add_argument("--encode-threads", type=int, default=2, help="torch threads of the encode; default 2")
    args = p.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if ray.is_initialized():  # a driver of a cluster already (the smoke test on the test cluster)
        return emit(measure(args), indent=2)
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
        try:
            return emit(measure(args), indent=2)
        finally:
            ray.shutdown()
    from benchmarks.fake_cluster import fake_cluster

    # Object stores big enough for one real-size RefKV on each of the two nodes.
    store = 300_000_000 if args.smoke else 2_200_000_000
    with fake_cluster(max_gpu_nodes=2, object_store_bytes=store) as cluster, cluster.connected():
        return emit(measure(args), indent=2)


if __name__ == "__main__":
    main()
