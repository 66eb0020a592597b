"""`tandem train-draft` flags (each with a TANDEM_TRAIN_* environment fallback) and the
TrainConfig they build. Unset sizes take the mode's default: the full recipe for the default
model, or --quick (a tiny model, built-in prompts, seconds)."""

import argparse
import json
import os
import sys
from pathlib import Path

from tandem.envvars import env_flag
from tandem.train.config import DTYPES, METHODS, SCHEDULES, TrainConfig  # light: torch comes with the command

FULL = {"num_prompts": 1920, "max_prompt_tokens": 256, "max_new_tokens": 256, "shard_prompts": 96, "gen_batch": 48,
        "feature_batch_tokens": 8192, "steps": 2000, "batch_size": 16, "warmup_steps": 100, "checkpoint_every": 200,
        "log_every": 10, "compute_dtype": "bfloat16", "target_dtype": "bfloat16", "threads": 0, "eval_mtbench": 20}
QUICK = {"num_prompts": 24, "max_prompt_tokens": 48, "max_new_tokens": 16, "shard_prompts": 8, "gen_batch": 8,
         "feature_batch_tokens": 1024, "steps": 30, "batch_size": 8, "warmup_steps": 0, "checkpoint_every": 10,
         "log_every": 5, "compute_dtype": "float32", "target_dtype": "float32", "threads": 1, "eval_mtbench": 0}
LR = {("eagle", False): 3e-4, ("medusa", False): 1e-3, ("eagle", True): 3e-3, ("medusa", True): 3e-3}


def _env(name: str):
    return os.environ.get(f"TANDEM_TRAIN_{name.upper()}")


def _env_flag(name: str):
    return env_flag(f"TANDEM_TRAIN_{name.upper()}")


def _flag(p, name: str, kind=int, help: str = "", **kw) -> None:
    """--name with default TANDEM_TRAIN_NAME, else None (the mode's default)."""
    p.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=_env(name), help=help, **kw)


def add_train_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=METHODS, default=_env("method") or "eagle")
    _flag(p, "model", str, "target HF folder (default: SmolLM2-135M-Instruct bfloat16; --quick: a tiny model)")
    _flag(p, "out", str, "run folder (default: $TANDEM_HOME/train/<method>-default; --quick: quick-<method>)")
    _flag(p, "data_dir", str, "self-distillation shards (default: $TANDEM_HOME/train-data/<model>-<key>)")
    p.add_argument("--extra-data", action="append", metavar="DIR",
                   default=[d for d in (_env("extra_data") or "").split(os.pathsep) if d],
                   help="also train on the training shards of this self-distillation folder (made for the same "
                        "target, e.g. by a --turn 2 or --skip-prompts run); repeatable; the held-out shard "
                        "stays --data-dir's")
    p.add_argument("--resume", action="store_true", default=_env_flag("resume"),
                   help="continue the run's last checkpoint (and its data); a run without one starts")
    _flag(p, "eval_head", str, "evaluate this head folder (e.g. a shipped head) on MT-bench and, when the data "
                                "has it, the held-out shard; no training (writes evaluation.json into --out)")
    p.add_argument("--quick", action="store_true", default=_env_flag("quick"),
                   help="tiny target, built-in prompts, a few steps (seconds; for tests)")
    _flag(p, "max_minutes", float, "end the sitting cleanly (checkpoint, head, exit 0) after this long; 0: no limit")
    _flag(p, "num_prompts", help="training prompts (whole shards; a held-out shard comes on top)")
    _flag(p, "skip_prompts", help="leave out the first N training prompts, e.g. those an --init-head head was "
                                  "trained on (the held-out shard stays the same; default 0)")
    p.add_argument("--turn", type=int, choices=(1, 2), default=int(_env("turn") or 1),
                   help="prompts: ShareGPT's first user turns (1), or second user turns after the conversation's "
                        "first exchange (2: other data, for a head already trained on the first turns)")
    _flag(p, "max_prompt_tokens", help="chat-templated prompt length cap")
    _flag(p, "max_new_tokens", help="answer length cap")
    _flag(p, "gen_batch", help="sequences per generation batch")
    _flag(p, "feature_batch_tokens", help="padded tokens per hidden-state batch")
    _flag(p, "target_dtype", str, "dtype the target runs in for answers and features", choices=DTYPES)
    _flag(p, "answers_from", str, "take the answers from this self-distillation folder of the same prompts, made "
                                  "by the target in its other dtype, and make only the features, in --target-dtype "
                                  "(the dtype the head is to be served with)")
    _flag(p, "steps", help="total optimizer steps of the run")
    _flag(p, "batch_size", help="sequences per step")
    _flag(p, "lr", float, "peak learning rate (default eagle 3e-4, medusa 1e-3)")
    _flag(p, "warmup_steps", help="linear warm-up (default: 100, at most a tenth of --steps)")
    p.add_argument("--schedule", choices=SCHEDULES, default=_env("schedule") or "cosine")
    _flag(p, "clip", float, "gradient-norm clip (default 1.0)")
    _flag(p, "weight_decay", float, "AdamW weight decay (default 0)")
    _flag(p, "checkpoint_every", help="steps between checkpoints")
    _flag(p, "log_every", help="steps between loss records")
    _flag(p, "compute_dtype", str, "matmul dtype in training (fp32 master weights)", choices=DTYPES)
    _flag(p, "threads", help="torch threads (0: torch's default)")
    _flag(p, "seed")
    _flag(p, "eval_mtbench", help="also evaluate the head on the target's answers to the first N MT-bench "
                                  "questions (default 20; --quick: 0)")
    p.add_argument("--format", dest="save_format", choices=["safetensors", "bin"],
                   default=_env("format") or "safetensors", help="weights file of the head")
    _flag(p, "ce_weight", float, "EAGLE: weight of the token loss, CE or --soft-labels' KL (default 0.1, EAGLE-1's)")
    p.add_argument("--cut-loops", action="store_true", default=_env_flag("cut_loops"),
                   help="end each training answer that loops (tandem.loops: over 30%% of its 8-grams repeat an earlier "
                        "one) where it first repeats itself: a small target's greedy answers often loop, and copying is easy")
    p.add_argument("--soft-labels", action="store_true", default=_env_flag("soft_labels"),
                   help="EAGLE: the token loss is the KL from the target's next-token distribution over the draft "
                        "vocabulary (its logits from the cached features) instead of CE on its greedy token")
    _flag(p, "ttt_steps", help="EAGLE: draft steps unrolled in training (1: EAGLE-1; >1: EAGLE-3 training-time test)")
    p.add_argument("--eagle3", action="store_true", default=_env_flag("eagle3"),
                   help="EAGLE: train an EAGLE-3 head: it reads the inputs of the target's layers 2, L/2 and L-3 "
                        "(made from the answers by one more prefill), ranks with its own norm and lm_head, and learns "
                        "from the token loss alone (an --eval-head or --init-head folder of EAGLE-3 implies it)")
    p.add_argument("--init-from-target", action="store_true", default=_env_flag("init_from_target"),
                   help="EAGLE: start the head's first layer from the target's last decoder layer")
    _flag(p, "draft_layers", help="EAGLE: decoder layers in the head (default 1, or --init-head's; more than "
                                  "--init-head's adds layers that start out adding nothing)")
    _flag(p, "init_head", str, "EAGLE: start from this head folder's weights and draft vocabulary (e.g. "
                               "heads/eagle-smollm2-135m, to train it on more answers with --skip-prompts)")
    _flag(p, "draft_vocab", help="prune the draft vocabulary to the N most frequent answer tokens (0: full); "
                                 "Medusa: only the served heads' ranking and the evaluation, not the loss")
    _flag(p, "medusa_heads", help="Medusa heads (default 4)")
    _flag(p, "medusa_layers", help="Medusa residual blocks per head (default 1)")
    p.add_argument("--medusa-lm-head", choices=["own", "shared"], default=_env("medusa_lm_head") or "own",
                   help="Medusa: train an own lm_head per head (Medusa-1; large) or share the target's (small)")


def _pick(args, name: str, mode: dict, fallback=None):
    value = getattr(args, name, None)
    return value if value is not None else mode.get(name, fallback)


def config_from_args(args) -> tuple[TrainConfig, Path]:
    """(the sitting's config, $TANDEM_HOME)."""
    from tandem.models.fetch import tandem_home
    from tandem.train.selfdistill import DataSpec, default_data_dir

    home, mode = tandem_home(), QUICK if args.quick else FULL
    name = f"quick-{args.method}" if args.quick else f"{args.method}-default"
    out = Path(args.out) if args.out else home / "train" / name
    _check_flags(args)  # before _target_dir, which may fetch and convert the model
    target = _target_dir(args, home, out)
    spec = DataSpec(target_dir=target, quick=args.quick, shard_prompts=mode["shard_prompts"],
                    skip_prompts=args.skip_prompts or 0, turn=args.turn,
                    answers_from=Path(args.answers_from) if args.answers_from else None, **{
        name: _pick(args, name, mode) for name in ("target_dtype", "num_prompts", "max_prompt_tokens", "max_new_tokens",
                                                   "gen_batch", "feature_batch_tokens")})
    steps = _pick(args, "steps", mode)
    data_dir = Path(args.data_dir) if args.data_dir else (out / "data" if args.quick else default_data_dir(home, spec))
    return TrainConfig(
        method=args.method, run_dir=out, data_dir=data_dir, data=spec, head_target_dir=target,
        steps=steps, batch_size=_pick(args, "batch_size", mode),
        lr=args.lr if args.lr is not None else LR[(args.method, args.quick)],
        warmup_steps=_pick(args, "warmup_steps", {"warmup_steps": min(mode["warmup_steps"], steps // 10)}), schedule=args.schedule, clip=_pick(args, "clip", mode, 1.0),
        weight_decay=_pick(args, "weight_decay", mode, 0.0), checkpoint_every=_pick(args, "checkpoint_every", mode),
        log_every=_pick(args, "log_every", mode), max_minutes=_pick(args, "max_minutes", mode, 0.0), resume=args.resume,
        seed=_pick(args, "seed", mode, 0), compute_dtype=_pick(args, "compute_dtype", mode),
        threads=_pick(args, "threads", mode), save_format=args.save_format, quick=args.quick,
        show_progress=True, ce_weight=_pick(args, "ce_weight", mode, 0.1), ttt_steps=_pick(args, "ttt_steps", mode, 1),
        soft_labels=args.soft_labels,
        init_from_target=args.init_from_target, init_head=Path(args.init_head) if args.init_head else None,
        draft_vocab=_pick(args, "draft_vocab", mode, 0), draft_layers=_pick(args, "draft_layers", mode, 0),
        medusa_heads=_pick(args, "medusa_heads", mode, 4), medusa_layers=_pick(args, "medusa_layers", mode, 1),
        medusa_lm_head=args.medusa_lm_head, eval_mtbench=_pick(args, "eval_mtbench", mode, 0),
        extra_data=tuple(Path(d) for d in args.extra_data), cut_loops=args.cut_loops,
        aux_layers=_aux_layers(args, target),
    ), home


def _aux_layers(args, target: Path) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads: an --eval-head / --init-head EAGLE-3 folder's,
    else with --eagle3 EAGLE-3's default (2, L/2, L-3); () for other heads."""
    from tandem.errors import InvalidArgument
    from tandem.models.config import ModelConfig
    from tandem.models.eagle3 import aux_layers_of

    if not _eagle3(args):
        return ()
    folder = args.eval_head or args.init_head
    raw = json.loads((Path(folder) / "config.json").read_text()) if folder else {}
    try:
        return aux_layers_of(raw, ModelConfig.from_folder(target).num_layers)
    except InvalidArgument as e:
        raise SystemExit(f"tandem train-draft: {folder}: {e}") from None


def _eagle3(args) -> bool:
    """Whether the run trains or evaluates an EAGLE-3 head: --eagle3, or an EAGLE-3 --eval-head /
    --init-head folder (an EAGLE-1/2 one with --eagle3 is refused)."""
    from tandem.models.eagle3 import is_eagle3_folder

    folder = args.eval_head or args.init_head
    if folder is None or not (Path(folder) / "config.json").is_file():
        return args.eagle3
    if args.eagle3 and not is_eagle3_folder(folder):
        raise SystemExit(f"tandem train-draft: --eagle3 with {folder}, an EAGLE-1/2 head")
    return args.method == "eagle" and is_eagle3_folder(folder)


def _check_flags(args) -> None:
    for name, least in (("skip_prompts", 0), ("steps", 0), ("batch_size", 1), ("ttt_steps", 1), ("num_prompts", 1),
                        ("draft_layers", 1)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise SystemExit(f"tandem train-draft: --{name.replace('_', '-')} must be {least} or more, not {value}")
    if args.turn != 1 and args.quick:
        raise SystemExit("tandem train-draft: --turn 2 takes ShareGPT's conversations; --quick has single prompts")
    if args.draft_layers is not None and args.method != "eagle":
        raise SystemExit("tandem train-draft: --draft-layers is for EAGLE heads")
    if args.soft_labels and args.method != "eagle":
        raise SystemExit("tandem train-draft: --soft-labels is for EAGLE (Medusa's heads train on the target's tokens)")
    clash = [flag for flag, given in (("--method medusa", args.method != "eagle"), ("--draft-layers", args.draft_layers),
                                      ("--init-from-target", args.init_from_target),
                                      ("--soft-labels", args.soft_labels)) if given]
    if clash and (args.eagle3 or _eagle3(args)):
        raise SystemExit(f"tandem train-draft: an EAGLE-3 head (--eagle3, or an EAGLE-3 --init-head / --eval-head) "
                         f"has one layer and trains on the token loss; it cannot go with {', '.join(clash)}")
    if not args.init_head:
        return
    clash = [flag for flag, given in (("--method medusa", args.method != "eagle"),
                                      ("--init-from-target", args.init_from_target),
                                      ("--draft-vocab", args.draft_vocab is not None),
                                      ("--eval-head", args.eval_head)) if given]
    if clash:  # the head brings its own layers and vocabulary
        raise SystemExit(f"tandem train-draft: --init-head is for EAGLE training and keeps the head's layers and "
                         f"draft vocabulary; it cannot go with {', '.join(clash)}")
    if not (Path(args.init_head) / "config.json").is_file():
        raise SystemExit(f"tandem train-draft: --init-head {args.init_head} is not a head folder (no config.json)")


def _target_dir(args, home: Path, out: Path) -> Path:
    if args.model:
        return Path(args.model)
    if args.quick:
        from tandem.testing.tiny import build_tiny_model

        tiny = out / "tiny-target"
        return tiny if (tiny / "config.json").is_file() else build_tiny_model(tiny)
    from tandem.models.fetch import fetch_default_model

    dtype = _pick(args, "target_dtype", FULL)
    return fetch_default_model(home, log=lambda m: print(m, file=sys.stderr))[dtype]


def cmd_train_draft(args) -> int:
    from tandem.errors import InvalidArgument
    from tandem.train.run import evaluate_head, run_train_draft

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    try:
        cfg, home = config_from_args(args)
        if args.eval_head:
            evaluate_head(cfg, home, Path(args.eval_head), log=log)
            print(f"evaluation of {args.eval_head} in {cfg.run_dir / 'evaluation.json'}")
            return 0
        record = run_train_draft(cfg, home, log=log)
    except InvalidArgument as e:  # a refused setting or run folder: the message, not a traceback
        raise SystemExit(f"tandem train-draft: {e}") from None
    ev = record.get("evaluation", {})
    print(f"{record['status']}: step {record.get('steps', 0)}/{cfg.steps}; head in {cfg.run_dir / 'head'}; "
          f"held-out top-1 {ev.get('heldout_top1', float('nan')):.3f}, "
          f"mean accepted length {ev.get('mean_accepted_length', float('nan')):.3f}")
    return 0
