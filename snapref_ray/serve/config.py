"""ServeConfig: everything the HTTP endpoint needs, one typed object.

The CLI (`snapref-ray serve`), `snapref_ray/serve/app.py` (`serve run` / `serve deploy`) and the
tests all build one of these; each field says why its default is what it is. Defaults are for a
GPU replica rendering ~1 MP images in a few seconds; the tests shrink them for a CPU.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from snapref_ray.job_spec import S3Spec
from snapref_ray.model_spec import ModelSpec
from snapref_ray.serve.errors import TOKEN_ENV


def is_loopback(host: str) -> bool:
    """True for a loopback IP literal (127.0.0.0/8, ::1). A name such as "localhost" is not trusted:
    what it resolves to is outside this process's control."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeLimits(BaseModel):
    """Bounds on what one HTTP request may ask for; anything beyond is a 400 (or 413) naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_upload_bytes: int = Field(
        20 * 2**20,
        gt=0,
        description="Largest reference image file accepted (bytes). 20 MiB holds any PNG of a 64 MP"
        " reference (the decoder's own bomb limit) that is not padded; a character sheet is"
        " usually < 5 MiB.",
    )
    max_megapixels: float = Field(
        2.1,
        gt=0,
        description="Largest output area (width*height/1e6) and largest ref_megapixels. 2.1 MP admits"
        " Anima's ~1 MP training buckets up to 1536x1344; more multiplies memory and time"
        " per request, so a larger value is a deliberate operator choice.",
    )
    max_prompt_chars: int = Field(
        4000,
        gt=0,
        description="Longest prompt, negative prompt or ref_caption (characters). Anima's text path"
        " truncates far below this; the bound only stops abusive bodies.",
    )
    max_steps: int = Field(
        100,
        gt=0,
        description="Most sampling steps per request. Anima's card recommends 28-50; 100 leaves room"
        " for experiments while capping one request's device time.",
    )
    max_n: int = Field(
        4,
        gt=0,
        description="Most images per request (consecutive seeds, one batch). Also capped by"
        " max_batch, since one request must fit in one batched forward.",
    )
    max_side: int = Field(
        2048,
        gt=0,
        description="Longest image side in pixels. 2048 covers Anima's tall/wide buckets; the request"
        " model itself allows 4096, which a shared endpoint should not.",
    )
    max_form_parts: int = Field(
        8,
        gt=0,
        description="Most parts in a multipart upload. An upload has at most three (file, ref_caption,"
        " ref_megapixels); the bound stops a body of 300,000 tiny parts at its ninth.",
    )
    max_part_header_bytes: int = Field(
        4096,
        gt=0,
        description="Largest header block of one multipart part (bytes). A Content-Disposition with a long"
        " file name fits in a few hundred bytes.",
    )


class ServeConfig(BaseModel):
    """The endpoint: models, network, auth, limits, autoscaling, backpressure, batching, caching."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- models ------------------------------------------------------------------------------
    model: ModelSpec = Field(
        ...,
        description="The model every renderer replica loads: the same `ModelSpec` (models folder or files,"
        " adapter, LoRAs, dtype, device, compile, quantize) as a job spec's `model:` and the CLI's flags."
        " A plain string is a models folder.",
    )

    # -- network and auth --------------------------------------------------------------------
    host: str = Field(
        "127.0.0.1",
        description="Address the HTTP proxy binds. Loopback by default so that nothing is exposed by"
        " accident; any other address requires a token.",
    )
    port: int = Field(8000, ge=1, le=65535, description="HTTP port; 8000 is Ray Serve's own default.")
    direct_ingress: bool = Field(
        True,
        description="Local server (`snapref-ray serve`, start_local_serve): HAProxy answers `port` and forwards"
        " straight to the ingress replicas, which render (fused) or call the renderers over gRPC"
        " (split; Ray Serve's HAProxy mode with direct ingress), instead of Serve's HTTP proxy"
        " and actor calls:"
        " ~20 ms less per request on 2 CPU cores. Needs the haproxy binary (else Serve's proxy"
        " is used, with a warning) and applies when start_local_serve starts Ray. A cluster started"
        " by `ray start` or KubeRay sets this in its own environment (README.md, Serving).",
    )
    token: SecretStr | None = Field(
        None,
        description=f"Bearer token clients must send. None reads ${TOKEN_ENV}; required whenever host is"
        " not loopback. A SecretStr, so it never shows in reprs or logs.",
    )
    limits: ServeLimits = Field(
        default_factory=ServeLimits,
        description="Per-request bounds, tighter than the request model's own so one request cannot hold a "
        "GPU for long.",
    )

    # -- replicas and autoscaling ------------------------------------------------------------
    topology: Literal["auto", "fused", "split"] = Field(
        "auto",
        description="Where requests are rendered. 'split': CPU ingress replicas parse, authenticate and"
        " validate, then call renderer replicas (one per GPU) through Serve's router, which"
        " sends each reference to the replicas that hold its K/V and queues for all of them."
        " 'fused': each renderer replica is also the HTTP ingress and renders in-process, one"
        " hop less per request (~5 ms on 2 CPU cores), but the front balances by open"
        " connections, not by reference, and each replica queues for itself. 'auto': fused"
        " when max_replicas, min_replicas and ingress_replicas are 1 (one renderer that never"
        " scales to zero: nothing to route), else split.",
    )
    gpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="GPUs per renderer replica. None: 1 when the cluster has GPUs (one resident model"
        " per GPU, as the batch workers), else 0 (CPU replicas).",
    )
    memory_per_replica: int | None = Field(
        None,
        ge=0,
        description="Bytes of host memory each rendering replica asks Ray for (`memory=`), and the budget its render"
        " service fits batches into on a CPU (as a job worker's). None: estimated from the model files at the"
        " largest image the limits allow and max_batch (docs/serving.md); 0: none. Model files the deploying"
        " process cannot read (s3://, a path only the GPU nodes have) ask for none.",
    )
    cpus_per_replica: float = Field(
        1.0,
        gt=0,
        description="CPUs per renderer replica: PNG encoding and the event loop need one; a CPU-only"
        " replica's torch uses as many threads as this allows.",
    )
    min_replicas: int = Field(
        1,
        ge=0,
        description="Renderer replicas kept warm. 1: loading Anima takes ~20-60 s, far longer than a"
        " client waits, so scaling to zero costs the first request a timeout.",
    )
    max_replicas: int = Field(4, ge=1, description="Upper bound on renderer replicas (= GPUs the endpoint may hold).")
    target_ongoing_requests: float = Field(
        2.0,
        gt=0,
        description="Autoscaling target per replica. 2: one batch rendering and one forming; higher"
        " values batch more but add a render's worth of queueing to the latency.",
    )
    upscale_delay_s: float = Field(
        30.0,
        ge=0,
        description="Load must stay above target this long before a replica is added. A new GPU replica"
        " needs a model load (and maybe a node), so reacting to a 5 s burst only wastes it.",
    )
    downscale_delay_s: float = Field(
        600.0,
        ge=0,
        description="Load must stay below target this long before a replica is removed. Long, because"
        " a removed replica drops its cached references and its model load.",
    )

    # -- backpressure and timeouts -----------------------------------------------------------
    max_ongoing_requests: int = Field(
        8,
        ge=1,
        description="Requests a renderer replica holds at once (rendering, waiting for the device, or"
        " forming a batch). At least max_batch so a full batch can form; Serve's"
        " default (5) would cap batches below that.",
    )
    max_queued_requests: int = Field(
        16,
        ge=1,
        description="Requests the ingress may hold for the renderers when every replica is full; past"
        " it clients get 503 + Retry-After at once. Serve's default (-1) queues without"
        " bound, which turns a burst into timeouts for everyone. ~2 batches per replica.",
    )
    ingress_max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="Concurrent HTTP requests per ingress replica. The ingress only parses and awaits,"
        " so it holds many; the renderer queue above is the real bound.",
    )
    ingress_max_queued_requests: int = Field(
        256,
        ge=1,
        description="HTTP requests the proxy queues for the ingress; past it the proxy answers 503 with"
        " Retry-After itself (Serve's backpressure).",
    )
    # -- hostile clients: bodies that never finish ------------------------------------------
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A request body must arrive within this many seconds (else 408). 60 s carries a 20 MiB"
        " upload at ~350 kB/s; a client slower than that is better off retrying.",
    )
    body_min_rate_bytes_s: float = Field(
        8192.0,
        ge=0,
        description="After body_grace_s, a body must keep arriving at least this fast on average (else"
        " 408). 8 kB/s is far below any real link and far above a byte every few seconds.",
    )
    body_grace_s: float = Field(
        5.0, ge=0, description="Seconds before the minimum rate applies (connection set-up, TCP slow start)."
    )
    fast_body_s: float = Field(
        1.0,
        gt=0,
        description="A body that arrives within this many seconds needs no slow-upload slot, so well-behaved"
        " clients are never refused because slow ones hold the slots.",
    )
    max_slow_bodies: int = Field(
        32,
        ge=1,
        description="Bodies per ingress replica that may take longer than fast_body_s at once. Past it a"
        " slow body is answered 503 + Retry-After by the ingress itself, so slow clients can"
        " never fill the ingress's request slots (ingress_max_ongoing_requests) and starve"
        " health checks and normal requests.",
    )
    public_docs: bool = Field(
        False,
        description="Serve /docs and /openapi.json without the token. Off: with a token configured they"
        " need it too (they list every limit and field of the API).",
    )
    ingress_replicas: int = Field(
        1, ge=1, description="Ingress replicas of the split topology; one handles thousands of requests/s of parsing."
    )
    request_timeout_s: float = Field(
        300.0,
        gt=0,
        description="A render that has not answered by then gets 504. 300 s is ~10 batched 1 MP renders"
        " on one GPU; the HTTP proxy's own timeout is set a little above so the JSON 504"
        " wins over its bare 408.",
    )
    retry_after_s: float = Field(
        5.0, ge=0, description="Retry-After on 503s: about one batched render, when a queue slot is likely free."
    )
    stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description="check_health fails (and Serve restarts the replica) when the device has been busy"
        " this long without finishing a sampling step or an encode: a hung CUDA call or"
        " deadlock, since a real step takes well under a second.",
    )
    health_check_period_s: float = Field(10.0, gt=0, description="Serve's health-check period (its default).")

    # -- batching and caching ----------------------------------------------------------------
    max_batch: int = Field(
        4,
        ge=1,
        description="Most images per batched forward, as a job's `cluster.max_batch` and Ray Data's `max_batch`"
        " (the memory fit may choose fewer). 4 fills an H100 at 1 MP with CFG's two rows without running out"
        " of memory; more gives little throughput for a lot of latency.",
    )
    warmup_sizes: tuple[tuple[int, int], ...] = Field(
        (),
        description="(width, height) sizes a compiled replica builds its graphs for, at batch sizes 1..max_batch,"
        " before it reports ready (render_service/cold_start.py): the first request at these sizes then pays no"
        " compile."
        " With a shared model.compile_cache a new replica loads them (seconds) instead of building them (minutes).",
    )
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        description="How long an idle replica waits for more compatible requests before rendering. 0:"
        " a lone request starts at once (a window is pure latency for it), and requests"
        " that queue while the device is busy are merged into the next forward anyway,"
        " which is where batching pays. A few ms helps only when clients send bursts of"
        " compatible requests to an idle replica.",
    )
    refkv_cache_bytes: int = Field(
        8 * 2**30,
        gt=0,
        description="RefKV cache per replica (bytes on its device). A 1 MP reference is ~0.94 GB of"
        " bf16 K/V, so 8 GiB keeps ~8 references next to Anima's ~5 GB on a 24 GB GPU.",
    )
    references_uri: str | None = Field(
        None,
        description="Where uploaded references are kept durably: a local folder (shared by every node, e.g."
        " NFS) or s3://bucket/prefix. Content-addressed (files/<sha256>, references/<id>.json), so"
        " a restarted store or replica serves old ids without a re-upload; the in-memory LRU"
        " (reference_store_bytes) is then only a cache. None: memory only, lost on restart.",
    )
    reference_store_replicas: int = Field(
        1,
        ge=1,
        description="ReferenceStore replicas. 1 without references_uri (an upload and the replica that"
        " encodes it must meet in one memory); with durable storage any number can share it.",
    )
    s3: S3Spec = Field(
        default_factory=S3Spec,
        description="S3 client settings for s3:// model files and references_uri: the same section as a job"
        " spec's `output.s3` (endpoint, region, retry mode, attempts), so a throttled store is retried alike."
        " Credentials come from the node's AWS chain (environment, instance profile), never from this config.",
    )
    model_cache_dir: str | None = Field(
        None,
        description="Per-node cache for s3:// model files (downloaded once per node however many replicas"
        " start); None: $SNAPREF_RAY_CACHE or ~/.cache/snapref-ray/models, as for batch jobs.",
    )
    reference_store_bytes: int = Field(
        1 * 2**30,
        gt=0,
        description="Uploaded reference files kept for the replicas to encode from (LRU, bytes). 1 GiB"
        " is ~500 typical 2 MB uploads; an evicted reference answers 404 and is uploaded again.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ServeConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must not exceed max_replicas ({self.max_replicas})")
        if self.limits.max_upload_bytes > self.reference_store_bytes:
            raise ValueError(
                f"limits.max_upload_bytes ({self.limits.max_upload_bytes}) must not exceed"
                f" reference_store_bytes ({self.reference_store_bytes}): the store must hold an upload"
            )
        if self.limits.max_n > self.max_batch:
            raise ValueError(
                f"limits.max_n ({self.limits.max_n}) must not exceed max_batch"
                f" ({self.max_batch}): one request's images render in one batch"
            )
        if self.reference_store_replicas > 1 and self.references_uri is None:
            raise ValueError(
                f"reference_store_replicas={self.reference_store_replicas} needs references_uri: without"
                " durable storage an upload lives in one replica's memory"
            )
        if self.topology == "fused" and self.ingress_replicas != 1:
            raise ValueError(
                f"ingress_replicas={self.ingress_replicas} applies to the split topology: fused"
                " replicas are the renderers (min_replicas..max_replicas)"
            )
        if self.max_slow_bodies >= self.ingress_max_ongoing_requests:
            raise ValueError(
                f"max_slow_bodies ({self.max_slow_bodies}) must stay below ingress_max_ongoing_requests"
                f" ({self.ingress_max_ongoing_requests}): slow uploads must never hold every slot"
            )
        return self

    def fused(self) -> bool:
        """Whether the ingress replicas render themselves (topology, with 'auto' resolved)."""
        if self.topology == "auto":
            # min_replicas 0: a CPU ingress stays up to answer health, docs and uploads while no renderer runs.
            return self.max_replicas == 1 and self.ingress_replicas == 1 and self.min_replicas >= 1
        return self.topology == "fused"

    def s3_options(self):
        """S3Options for the s3:// paths above (the `s3` section; credentials from the environment)."""
        return self.s3.options()

    def resolved_token(self) -> str | None:
        """The token from the config, else from $SNAPREF_API_TOKEN; None when neither is set."""
        if self.token is not None and self.token.get_secret_value():
            return self.token.get_secret_value()
        return os.environ.get(TOKEN_ENV) or None

    def check_security(self, host: str | None = None) -> None:
        """Refuse a server reachable from other machines without a token (raises ValueError)."""
        host = self.host if host is None else host
        if not is_loopback(host) and self.resolved_token() is None:
            raise ValueError(
                f"host {host!r} is not loopback: set a bearer token (--token or ${TOKEN_ENV})"
                " before exposing the endpoint"
            )

    def proxy_timeout_s(self) -> float:
        """The HTTP proxy's request timeout: above ours, so that clients see our JSON 504."""
        return self.request_timeout_s + 10.0
