"""The configuration of one `tandem train-draft` sitting, built once by the CLI."""

from __future__ import annotations  # DataSpec's module imports torch: not for `tandem --help`

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.train.selfdistill import DataSpec

DTYPES = ("float32", "bfloat16")  # the target's and the training matmuls'
METHODS = ("eagle", "medusa")
SCHEDULES = ("cosine", "linear")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    method: str  # "eagle" or "medusa"
    run_dir: Path  # checkpoints, the final head (head/), training.json
    data_dir: Path  # self-distillation shards (shared by runs on the same data)
    data: DataSpec
    head_target_dir: Path  # the target folder whose config, embedding and lm_head the head uses
    steps: int  # total optimizer steps of the run (a resumed run continues up to it)
    batch_size: int  # sequences per step
    lr: float
    warmup_steps: int
    schedule: str  # decay after warm-up, to 0: "cosine" or "linear"
    clip: float  # gradient-norm clipping
    weight_decay: float
    checkpoint_every: int  # steps
    log_every: int  # steps
    max_minutes: float  # 0: no limit; else checkpoint and exit when the sitting has run this long
    resume: bool
    seed: int
    compute_dtype: str  # "bfloat16" (AMX matmuls here) or "float32"
    threads: int  # torch threads, 0: torch's default
    save_format: str  # "safetensors" or "bin"
    quick: bool
    show_progress: bool = True
    extra_data: tuple[Path, ...] = ()  # other self-distilled folders whose training shards join the run's
    cut_loops: bool = False  # training answers that loop end where they first repeat themselves
    # EAGLE
    ce_weight: float = 0.1  # EAGLE-1's p_w: loss = SmoothL1(features) + ce_weight * CE
    soft_labels: bool = False  # token loss: KL from the target's distribution, not CE on its greedy token
    ttt_steps: int = 1  # draft steps unrolled in training (1: EAGLE-1 teacher forcing; >1: EAGLE-3's TTT)
    init_from_target: bool = False  # the head's layer starts as the target's last decoder layer
    draft_layers: int = 0  # decoder layers of the head; 0: the --init-head's (or resumed run's), else 1
    init_head: Path | None = None  # a head folder whose weights and draft vocabulary the run starts from
    draft_vocab: int = 0  # 0: the full vocabulary; N: the N most frequent answer tokens (EAGLE-3 d2t)
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: the target layers whose inputs the head reads; (): EAGLE-1/2
    eval_chain: int = 4  # k of the greedy chains whose accepted length is estimated
    eval_mtbench: int = 0  # also evaluate on the target's answers to this many MT-bench questions
    # Medusa
    medusa_heads: int = 4
    medusa_layers: int = 1
    medusa_lm_head: str = "own"  # "own" (trained, initialised from the target's) or "shared" (frozen)

    def __post_init__(self):
        assert self.method in METHODS, self.method
        assert self.schedule in SCHEDULES, self.schedule
        assert self.medusa_lm_head in ("own", "shared"), self.medusa_lm_head
        assert self.steps >= 0 and self.batch_size > 0 and self.ttt_steps >= 1

    def to_dict(self) -> dict:
        from tandem.train.selfdistill import spec_dict

        out = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
        out["extra_data"] = [str(d) for d in self.extra_data]
        out["aux_layers"] = list(self.aux_layers)
        out["data"] = spec_dict(self.data)
        return out
