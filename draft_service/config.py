"""Configuration of the draft service: built once in the CLI, frozen, passed down."""

from dataclasses import dataclass
from pathlib import Path

from tandem.errors import InvalidArgument
from tandem.models.kernel_plan import KernelPlan
from tandem.security.identity import Identities
from tandem.security.tls import PLAINTEXT, TlsConfig

LM_HEAD_QUANTS = ("none", "int8")


@dataclass(frozen=True, slots=True)
class DraftConfig:
    method: str  # a key of draft_service.methods.DRAFT_METHODS
    model_dir: Path  # the draft head's checkpoint folder
    target_model_dir: Path  # the target's folder: the head shares its embedding and lm_head
    target_address: str = "127.0.0.1:50052"  # where the peer stream goes
    dtype: str = "float32"
    device: str = "cpu"
    host: str = "127.0.0.1"
    port: int = 50053
    kv_page_size: int = 16
    kv_cache_tokens: int = 32768
    max_num_sequence: int = 64
    num_threads: int = 0
    # The CPU kernel of each projection for 1..3 rows (--cpu-kernels); None: EAGLE times its own
    # when it loads on CPU, Medusa takes tandem.models.kernel_plan.DEFAULT_PLAN.
    cpu_kernels: KernelPlan | None = None
    # How long a Draft call waits for the target step whose hidden states it needs.
    hidden_timeout_s: float = 10.0
    # Draft shape: "chain" (k tokens, k from the router) or "tree" (verified as a token tree).
    shape: str = "chain"
    # EAGLE trees (EAGLE-2's dynamic tree): expand the top_k most probable frontier nodes by
    # their top_k children per depth, keep the node_budget most probable nodes.
    tree_top_k: int = 4
    tree_node_budget: int = 16
    # Sampled requests: the draft proposes from its own top proposal_top_k tokens (within the
    # request's top-k/p), renormalised; 0: the request's whole distribution. Any proposal is
    # lossless, as the target verifies with the one the drafts came from, and a short one travels
    # as sparse rows instead of [V] floats per draft token; but it accepts less. Served at
    # temperature 1 with the shipped EAGLE head (10 MT-bench questions): top-64 against whole, a
    # depth-4 top-8 30-node drawn tree 1.67 against 1.90 tokens a verify, chains of 4 1.41
    # against 1.45. A cut proposal never drafts the target's tail, which recursive rejection
    # then leaves in the residual for every later sibling. Hence off by default.
    proposal_top_k: int = 0
    # The draft's lm_head (the pruned one where the head has a d2t map): "int8" scores with an
    # int8 copy, one scale per row (CPU only; tandem.models.linear.Int8Linear), "none" in `dtype`.
    # Drafts only propose: verification stays the target's, lossless either way.
    lm_head_quant: str = "none"
    # EAGLE: the head's own projections (fc and its decoder layers), "int8" or "none" as
    # lm_head_quant (CPU only). Medusa's residual blocks stay in `dtype`.
    head_quant: str = "none"
    # Medusa trees: a preset name of tandem.spec.token_tree or a JSON list of rank tuples.
    medusa_choices: str = ""
    # Structured output: a constrained sequence drafts from its grammar (masked proposals, forced
    # tokens free; docs/structured-output.md). False: unconstrained drafts (the target still
    # verifies on the masked distribution: lossless either way, it only accepts less).
    constrained_drafts: bool = True
    # On a CUDA device, small steps replay captured CUDA graphs (tandem.models.cuda_graphs).
    cuda_graphs: bool = True
    # Prometheus /metrics over HTTP on this port, on `host` (0: off).
    metrics_port: int = 0
    # TLS on the port (with a CA: mutual TLS, methods authorized by the caller's identity) and
    # on outgoing channels; a plaintext port answering health Checks only, for probes (0: none).
    tls: TlsConfig = PLAINTEXT
    identities: Identities = Identities()
    health_port: int = 0

    @property
    def is_tree(self) -> bool:
        return self.shape == "tree"

    def __post_init__(self) -> None:
        if self.shape not in ("chain", "tree"):
            raise InvalidArgument(f"shape must be 'chain' or 'tree', got {self.shape!r}")
        if self.tree_top_k <= 0 or self.tree_node_budget <= 0:
            raise InvalidArgument("tree_top_k and tree_node_budget must be positive")
        if self.lm_head_quant not in LM_HEAD_QUANTS:
            raise InvalidArgument(f"lm_head_quant must be one of {LM_HEAD_QUANTS}, got {self.lm_head_quant!r}")
        if self.lm_head_quant == "int8" and self.device != "cpu":
            raise InvalidArgument(f"an int8 lm_head runs on CPU only, not on {self.device}")
        if self.head_quant not in LM_HEAD_QUANTS:
            raise InvalidArgument(f"head_quant must be one of {LM_HEAD_QUANTS}, got {self.head_quant!r}")
        if self.head_quant == "int8" and (self.device != "cpu" or self.method != "eagle"):
            raise InvalidArgument(f"int8 head projections are an EAGLE head's, on CPU only, not {self.method} on {self.device}")
        if self.proposal_top_k < 0:
            raise InvalidArgument(f"proposal_top_k must be >= 0 (0: off), got {self.proposal_top_k}")
        if self.kv_cache_tokens < self.kv_page_size or self.kv_page_size <= 0:
            raise InvalidArgument(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold a page ({self.kv_page_size})")
