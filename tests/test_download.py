"""`macaron models pull` against a local fake of the Hugging Face Hub (tests/fake_hub.py).

Each test serves a tiny real GGUF (a few KB, built with gguf-py) so the whole path runs for real:
huggingface_hub's HEAD and GET, the redirect to the "CDN", Range resumes, the sha256 check, the
GGUF parse, PEFT conversion. Nothing here reaches the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import socket
from collections import namedtuple
from pathlib import Path

import filelock
import gguf
import numpy as np
import pytest
import tomli_w
from fake_hub import FakeHub, use_fake_hub
from huggingface_hub import constants as hf_constants
from safetensors.numpy import save as save_safetensors

from macaron_local import secrets
from macaron_local.adapters import LoraAdapter, LoraPair, write_adapter
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog, Manifest
from macaron_local.download import PULL_DIR, check_free_disk, pull, verify_sha256
from macaron_local.errors import DownloadError, ModelError
from macaron_local.settings import Settings

REPO = "tiny-org/tiny-GGUF"
FILE = "tiny-Q8_0.gguf"
GATED = "tiny-org/gated-GGUF"
EXPERTS = "tiny-org/tiny-experts"
TOKEN = "hf_fakeSECRETtoken0123456789"
N_EMBD, N_FF, N_VOCAB = 8, 16, 64
#: huggingface_hub writes a stream to disk in chunks of `constants.DOWNLOAD_CHUNK_SIZE` (10 MB):
#: bytes of an unfinished chunk are lost when a connection drops, so a resume starts at the last
#: whole chunk. Shrunk here so a file of a few KB resumes the way a 20 GB one does.
CHUNK = 512


def build_tiny_gguf(path: Path) -> bytes:
    """A small llama-architecture base model: enough metadata and tensors to parse and to take
    a LoRA on `blk.0.ffn_up`, and a few KB so a transfer can be cut in the middle."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_embedding_length(N_EMBD)
    writer.add_tensor("token_embd.weight", rng.standard_normal((N_VOCAB, N_EMBD), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((N_FF, N_EMBD), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    data = build_tiny_gguf(tmp_path_factory.mktemp("gguf") / FILE)
    assert len(data) > 2000
    return data


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model_bytes: bytes):
    """The fake hub serving the tiny model in a public and a gated repo; no token anywhere."""
    files = {(REPO, FILE): model_bytes, (GATED, FILE): model_bytes}
    with FakeHub(files, token=TOKEN, gated={GATED}) as fake:
        use_fake_hub(fake, monkeypatch, tmp_path / "hf-home")
        monkeypatch.setattr(secrets, "get_hf_token", lambda: None)  # not the user's keyring
        monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
        yield fake


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    settings = Settings.load(tmp_path / "home")
    settings.ensure_dirs()
    return settings


@pytest.fixture
def catalog(settings: Settings) -> Catalog:
    return Catalog(settings)


def add_manifest(settings: Settings, name: str = "tiny", experts: dict | None = None, **base) -> Manifest:
    """Write a user manifest whose base is a huggingface source (REPO/FILE unless overridden)."""
    data = {
        "name": name,
        "description": "test model",
        "architecture": "llama",
        "base": {"source": "huggingface", "repo": REPO, "file": FILE, **base},
        "experts": experts or {},
    }
    settings.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    path = settings.user_manifests_dir / f"{name}.toml"
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    return Manifest.from_toml(path)


def leftovers(catalog: Catalog, manifest: Manifest) -> list[Path]:
    """Partial downloads still lying around."""
    return sorted((catalog.model_dir(manifest) / PULL_DIR).rglob("*.part"))


# --- (1) and (2): download, then skip --------------------------------------------------------


def test_pull_downloads_the_base_into_the_model_dir_and_it_parses(hub, settings, catalog, model_bytes):
    manifest = add_manifest(settings)
    result = pull(catalog, manifest, progress=False)

    path = catalog.base_path(manifest)
    assert path == settings.models_dir / "tiny" / FILE
    assert path.read_bytes() == model_bytes
    assert BaseModelInfo.from_gguf(path).architecture == "llama"
    assert result.model == "tiny"
    assert result.files == [path]
    assert result.downloaded_bytes == len(model_bytes)
    assert result.skipped == []
    assert leftovers(catalog, manifest) == []
    # A .gguf is an LFS file: metadata from the hub, bytes from the CDN, each exactly once.
    assert [(r.server, r.method) for r in hub.requests] == [("hub", "HEAD"), ("cdn", "GET")]
    assert hub.bytes_served == len(model_bytes)


def test_a_second_pull_skips_the_file_without_touching_the_network(hub, settings, catalog, monkeypatch):
    manifest = add_manifest(settings)
    pull(catalog, manifest, progress=False)
    hub.reset_counters()

    def no_keyring() -> None:
        raise AssertionError("nothing to download: the keyring must not be opened")

    monkeypatch.setattr(secrets, "get_hf_token", no_keyring)

    result = pull(catalog, manifest, progress=False)

    assert result.skipped == [f"base {FILE}"]
    assert result.downloaded_bytes == 0
    assert result.files == [catalog.base_path(manifest)]
    assert hub.requests == []


def test_a_complete_file_already_in_place_is_adopted_not_downloaded(hub, settings, catalog, model_bytes):
    """Copied in by hand (no record): one HEAD proves it is the hub's file (LFS ETag = sha256)."""
    manifest = add_manifest(settings)
    path = catalog.base_path(manifest)
    path.parent.mkdir(parents=True)
    path.write_bytes(model_bytes)

    result = pull(catalog, manifest, progress=False)

    assert result.skipped == [f"base {FILE}"]
    assert hub.gets() == []


# --- (3): resume -----------------------------------------------------------------------------


def test_a_dropped_transfer_resumes_where_it_stopped(hub, settings, catalog, model_bytes):
    manifest = add_manifest(settings)
    cut = 2 * CHUNK
    hub.cut_next_transfer(cut)

    result = pull(catalog, manifest, progress=False)

    path = catalog.base_path(manifest)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hashlib.sha256(model_bytes).hexdigest()
    gets = hub.gets("cdn")
    assert [g.range for g in gets] == [None, f"bytes={cut}-"]
    assert hub.bytes_served == len(model_bytes) < 2 * len(model_bytes)
    assert result.downloaded_bytes == len(model_bytes)


def test_a_transfer_that_fails_after_progress_asks_the_hub_again_and_finishes(hub, settings, catalog, model_bytes):
    """huggingface_hub's own retry meets a 503 (as from an expired CDN link); since bytes had
    arrived, pull asks the hub for the file again (HEAD) and resumes in the same run."""
    manifest = add_manifest(settings)
    cut = 2 * CHUNK
    hub.cut_next_transfer(cut, then_fail=1)

    result = pull(catalog, manifest, progress=False)

    assert catalog.base_path(manifest).read_bytes() == model_bytes
    methods = [(r.server, r.method, r.range) for r in hub.requests]
    assert methods == [
        ("hub", "HEAD", None),
        ("cdn", "GET", None),  # cut after `cut` bytes
        ("cdn", "GET", f"bytes={cut}-"),  # huggingface_hub's retry: 503
        ("hub", "HEAD", None),  # a fresh location
        ("cdn", "GET", f"bytes={cut}-"),
    ]
    assert result.downloaded_bytes == len(model_bytes)


def test_a_pull_that_died_is_resumed_by_the_next_pull(hub, settings, catalog, model_bytes):
    """The first pull loses the hub mid-transfer and fails, keeping its partial file; the next
    pull asks only for the rest."""
    manifest = add_manifest(settings)
    cut = 3 * CHUNK
    hub.cut_next_transfer(cut, then_go_down=True)

    with pytest.raises(DownloadError, match="again to resume") as failure:
        pull(catalog, manifest, progress=False)
    assert "\n" not in str(failure.value)
    assert not catalog.base_path(manifest).exists()
    assert len(leftovers(catalog, manifest)) == 1

    hub.unavailable = False
    hub.reset_counters()
    result = pull(catalog, manifest, progress=False)

    assert catalog.base_path(manifest).read_bytes() == model_bytes
    assert [g.range for g in hub.gets()] == [f"bytes={cut}-"]
    assert hub.bytes_served == len(model_bytes) - cut
    assert result.downloaded_bytes == len(model_bytes) - cut
    assert leftovers(catalog, manifest) == []


def test_a_second_pull_of_the_same_file_at_the_same_time_is_refused(hub, settings, catalog):
    manifest = add_manifest(settings)
    lock_dir = catalog.model_dir(manifest) / PULL_DIR
    lock_dir.mkdir(parents=True)
    held = filelock.FileLock(str(lock_dir / f"{FILE}.lock"))
    with held, pytest.raises(DownloadError, match="another pull is already downloading"):
        pull(catalog, manifest, progress=False)
    assert hub.gets() == []
    pull(catalog, manifest, progress=False)
    assert catalog.base_path(manifest).is_file()


# --- (4): integrity --------------------------------------------------------------------------


def test_a_corrupted_transfer_is_rejected_and_discarded(hub, settings, catalog, model_bytes):
    manifest = add_manifest(settings)
    hub.corrupt[(REPO, FILE)] = bytes(len(model_bytes))  # right size, wrong bytes

    with pytest.raises(ModelError, match="sha256") as failure:
        pull(catalog, manifest, progress=False)

    assert "\n" not in str(failure.value)
    assert not catalog.base_path(manifest).exists()  # nothing looks like a usable model
    assert leftovers(catalog, manifest) == []  # and nothing corrupt is kept to resume from

    del hub.corrupt[(REPO, FILE)]
    pull(catalog, manifest, progress=False)
    assert catalog.base_path(manifest).read_bytes() == model_bytes


def test_a_manifest_sha256_that_does_not_match_the_download_is_refused(hub, settings, catalog, monkeypatch):
    """The manifest's pin is checked against the bytes; here the hub's ETag is not a sha256 (as
    for a non-LFS file) so the mismatch is only found after the transfer."""
    manifest = add_manifest(settings, sha256="ab" * 32)
    original = hub.is_lfs
    monkeypatch.setattr(hub, "is_lfs", lambda path: False if path == FILE else original(path))

    with pytest.raises(ModelError, match="does not match"):
        pull(catalog, manifest, progress=False)

    assert len(hub.gets()) == 1
    assert not catalog.base_path(manifest).exists()
    assert leftovers(catalog, manifest) == []


def test_a_manifest_sha256_that_contradicts_the_hub_fails_before_downloading(hub, settings, catalog):
    manifest = add_manifest(settings, sha256="ab" * 32)
    with pytest.raises(ModelError, match="manifest pins"):
        pull(catalog, manifest, progress=False)
    assert hub.gets() == []


def test_verify_sha256(tmp_path: Path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"hello")
    digest = hashlib.sha256(b"hello").hexdigest()
    verify_sha256(path, digest)
    verify_sha256(path, "sha256:" + digest.upper())
    with pytest.raises(ModelError, match="corrupt or not the expected file"):
        verify_sha256(path, "0" * 64)
    with pytest.raises(ModelError, match="cannot be read"):
        verify_sha256(tmp_path / "missing", digest)


# --- (5): disk space -------------------------------------------------------------------------


def test_not_enough_disk_for_the_manifest_size_fails_before_any_byte(hub, settings, catalog):
    manifest = add_manifest(settings, size=10**18)
    with pytest.raises(DownloadError, match=r"needs 1000000000\.0 GB free in .*, only .* available"):
        pull(catalog, manifest, progress=False)
    assert hub.gets() == []
    assert not catalog.base_path(manifest).exists()


def test_not_enough_disk_for_the_hub_size_fails_before_any_byte(hub, settings, catalog, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    manifest = add_manifest(settings)
    with pytest.raises(DownloadError, match=r"needs .* free in .*, only 100 bytes available") as failure:
        pull(catalog, manifest, progress=False)
    assert str(settings.models_dir / "tiny") in str(failure.value)
    assert hub.gets() == []


def test_check_free_disk_measures_the_nearest_existing_parent(tmp_path: Path):
    check_free_disk(tmp_path / "not" / "yet", 1)
    with pytest.raises(DownloadError, match="needs .* GB free in"):
        check_free_disk(tmp_path / "not" / "yet", 10**18)


# --- (6): hub errors are one line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("base", "message"),
    [
        ({"file": "missing.gguf"}, f"repo {REPO} file missing.gguf not found (404)"),
        ({"revision": "v9"}, f"repo {REPO} has no revision 'v9' (404)"),
        ({"repo": "tiny-org/nope"}, "access denied: repo tiny-org/nope is private, gated or does not exist"),
    ],
)
def test_hub_errors_become_one_line(hub, settings, catalog, base, message):
    manifest = add_manifest(settings, **base)
    with pytest.raises(DownloadError) as failure:
        pull(catalog, manifest, progress=False)
    assert message in str(failure.value)
    assert "\n" not in str(failure.value)
    assert not catalog.model_dir(manifest).joinpath(FILE).exists()


def test_an_unreachable_hub_is_one_line(hub, settings, catalog, monkeypatch):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    manifest = add_manifest(settings)
    with pytest.raises(DownloadError) as failure:
        pull(catalog, manifest, progress=False)
    assert str(failure.value) == f"cannot reach the model hub at http://127.0.0.1:{port}: connection refused"


def test_local_sources_are_only_checked(settings, catalog, tmp_path, model_bytes):
    local = tmp_path / "mine.gguf"
    manifest = add_manifest(settings, source="path", file=str(local))
    with pytest.raises(ModelError, match="does not exist"):
        pull(catalog, manifest, progress=False)
    local.write_bytes(model_bytes)
    result = pull(catalog, manifest, progress=False)
    assert result.files == [local]
    assert result.skipped == ["base mine.gguf"]


# --- (7): gated repos and the token ----------------------------------------------------------


def test_a_gated_repo_without_a_token_asks_to_log_in(hub, settings, catalog):
    manifest = add_manifest(settings, repo=GATED)
    with pytest.raises(DownloadError, match="access denied: .*macaron auth login") as failure:
        pull(catalog, manifest, progress=False)
    assert "\n" not in str(failure.value)
    assert hub.gets() == []


def test_a_gated_repo_with_the_token_downloads_and_never_shows_it(hub, settings, catalog, model_bytes, capfd, caplog):
    caplog.set_level(logging.DEBUG)
    manifest = add_manifest(settings, repo=GATED)
    hub.cut_next_transfer(100)  # also exercise the retry path's messages

    result = pull(catalog, manifest, progress=True, token=TOKEN)

    assert catalog.base_path(manifest).read_bytes() == model_bytes
    heads = [r for r in hub.requests if r.method == "HEAD"]
    assert heads and all(r.authorization == f"Bearer {TOKEN}" for r in heads)
    assert all(r.authorization is None for r in hub.gets("cdn"))  # never sent off the hub
    out, err = capfd.readouterr()
    records = (settings.models_dir / "tiny" / PULL_DIR).rglob("*")
    shown = out + err + caplog.text + repr(result)
    shown += "".join(p.read_text(errors="replace") for p in records if p.is_file())
    assert TOKEN not in shown


def test_the_stored_token_is_used_when_none_is_passed(hub, settings, catalog, monkeypatch):
    monkeypatch.setattr(secrets, "get_hf_token", lambda: TOKEN)
    manifest = add_manifest(settings, repo=GATED)
    pull(catalog, manifest, progress=False)
    assert catalog.base_path(manifest).is_file()


def test_a_rejected_token_asks_to_log_in_again(hub, settings, catalog):
    manifest = add_manifest(settings, repo=GATED)
    with pytest.raises(DownloadError, match="rejected your token; log in with `macaron auth login`") as failure:
        pull(catalog, manifest, progress=False, token="hf_wrong")
    assert "hf_wrong" not in str(failure.value)


# --- experts ---------------------------------------------------------------------------------


def peft_files(rank: int = 2) -> dict[str, bytes]:
    """A PEFT LoRA on layer 0's up projection of the tiny base."""
    rng = np.random.default_rng(1)
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    weights = {
        f"{prefix}.lora_A.weight": rng.standard_normal((rank, N_EMBD), dtype=np.float32),
        f"{prefix}.lora_B.weight": rng.standard_normal((N_FF, rank), dtype=np.float32),
    }
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["up_proj"]}
    return {
        "adapter_config.json": json.dumps(config).encode(),
        "adapter_model.safetensors": save_safetensors(weights),
    }


def test_experts_are_downloaded_converted_and_validated(hub, settings, catalog, tmp_path):
    for name, data in peft_files().items():
        hub.files[(EXPERTS, f"L0-chat/{name}")] = data
    rng = np.random.default_rng(2)
    gguf_lora = LoraAdapter(
        architecture="llama",
        alpha=4.0,
        pairs={
            "blk.0.ffn_up.weight": LoraPair(
                rng.standard_normal((2, N_EMBD), dtype=np.float32),
                rng.standard_normal((N_FF, 2), dtype=np.float32),
            )
        },
    )
    hub.files[(EXPERTS, "L1-agent/agent.gguf")] = write_adapter(tmp_path / "a.gguf", gguf_lora).read_bytes()
    experts = {
        "L0": {
            "name": "Chat",
            "source": "huggingface",
            "repo": EXPERTS,
            "subfolder": "L0-chat",
            "format": "peft",
        },
        "L1": {
            "name": "Agent",
            "source": "huggingface",
            "repo": EXPERTS,
            "subfolder": "L1-agent",
            "file": "agent.gguf",
        },
    }
    manifest = add_manifest(settings, experts=experts)

    result = pull(catalog, manifest, progress=False)

    base = BaseModelInfo.from_gguf(catalog.base_path(manifest))
    l0, l1 = catalog.expert_path(manifest, "L0"), catalog.expert_path(manifest, "L1")
    assert result.files == [catalog.base_path(manifest), l0, l1]
    for path in (l0, l1):
        assert validate_adapter(path, base).n_pairs == 1
    assert validate_adapter(l0, base).task_name == "L0 Chat"
    # vLLM loads PEFT: the converted expert points at the folder it came from, to stack on.
    from macaron_local.engine.remote.vllm import peft_folder

    assert (peft_folder(l0) / "adapter_config.json").read_bytes() == peft_files()["adapter_config.json"]
    assert not peft_folder(l1).exists()  # published as GGUF: nothing to stack for vLLM

    hub.reset_counters()
    again = pull(catalog, manifest, progress=False)
    assert again.skipped == [f"base {FILE}", "expert L0 Chat", "expert L1 Agent"]
    assert hub.requests == []


def test_an_expert_for_another_base_is_refused(hub, settings, catalog, tmp_path):
    rng = np.random.default_rng(3)
    wrong = LoraAdapter(
        architecture="llama",
        alpha=4.0,
        pairs={
            "blk.0.ffn_up.weight": LoraPair(
                rng.standard_normal((2, 99), dtype=np.float32),
                rng.standard_normal((N_FF, 2), dtype=np.float32),
            )
        },
    )
    hub.files[(EXPERTS, "bad.gguf")] = write_adapter(tmp_path / "bad.gguf", wrong).read_bytes()
    experts = {"L2": {"name": "Coding", "source": "huggingface", "repo": EXPERTS, "file": "bad.gguf"}}
    manifest = add_manifest(settings, experts=experts)
    with pytest.raises(Exception, match="lora_a has shape"):
        pull(catalog, manifest, progress=False)
    assert not catalog.expert_path(manifest, "L2").exists()
    assert catalog.base_path(manifest).is_file()  # the base is kept: the next pull skips it


# --- the fake hub itself ---------------------------------------------------------------------


def test_the_fake_hub_speaks_what_hf_hub_download_expects(hub, tmp_path, model_bytes):
    """Guards the fake: huggingface_hub's own downloader must accept its answers unchanged."""
    from huggingface_hub import hf_hub_download

    path = hf_hub_download(REPO, FILE, local_dir=tmp_path / "plain")
    assert Path(path).read_bytes() == model_bytes
    hub.files[(REPO, "sub/config.json")] = b"{}"
    path = hf_hub_download(REPO, "config.json", subfolder="sub", local_dir=tmp_path / "plain")
    assert Path(path).read_bytes() == b"{}"


def test_progress_callback_reports_bytes_and_can_cancel(hub, settings, catalog, model_bytes):
    """The app's first-run screen shows progress and offers cancel: a callback that raises
    DownloadCancelled stops the transfer, and the next pull resumes from what arrived."""
    from macaron_local.download import DownloadCancelled

    manifest, size = add_manifest(settings), len(model_bytes)
    seen: list[tuple[int, int | None]] = []

    def stop_halfway(name: str, done: int, total: int | None) -> None:
        seen.append((done, total))
        if done >= size // 2:
            raise DownloadCancelled("download cancelled")

    with pytest.raises(DownloadCancelled):
        pull(catalog, manifest, progress=stop_halfway)
    assert seen and seen[-1][1] == size and seen[-1][0] >= size // 2
    assert not catalog.base_path(manifest).exists()
    result = pull(catalog, manifest, progress=False)
    assert catalog.base_path(manifest).is_file()
    assert result.downloaded_bytes <= size - size // 2 + 1024
