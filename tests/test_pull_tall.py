"""`macaron models pull tall` against a local fake hub serving Tall's published layout.

The fake hub (tests/fake_hub.py, real HTTP on 127.0.0.1) serves the repositories and paths the
built-in Tall manifest names: `unsloth/Qwen3.6-35B-A3B-GGUF` with the base GGUF,
`mindlab-research/Macaron-V1-Tall` with `loras/L0..L3/{adapter_config.json,
adapter_model.safetensors}`, and the harness's profile files on a stand-in for GitHub's raw host.
The bytes are tiny stand-ins: the base is a tiny random llama GGUF (llama.cpp loads it), each
expert a rank-64 PEFT LoRA for it that declares the Qwen3.6-35B-A3B base, and the profile files
texts of the tests' own. The download, verification, expectation checks and Q8_0 conversion are
the real code paths; what is not exercised here is the 57 GB and the qwen35moe conversion.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from pathlib import Path

import gguf
import numpy as np
import pytest
import tomli_w
from conftest import run_cli
from fake_hub import FakeHub, use_fake_hub
from huggingface_hub import constants as hf_constants
from safetensors.numpy import save as save_safetensors

from macaron_local import secrets
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog, Manifest, builtin_manifest_dir
from macaron_local.download import PULL_DIR, pull
from macaron_local.errors import AdapterError, DownloadError, ModelError
from macaron_local.pull_plan import plan_pull
from macaron_local.settings import Settings

BASE_REPO = "unsloth/Qwen3.6-35B-A3B-GGUF"
BASE_FILE = "Qwen3.6-35B-A3B-UD-Q4_K_M.gguf"
EXPERTS_REPO = "mindlab-research/Macaron-V1-Tall"
HARNESS = "MindLab-Research/Mixture-of-LoRA-Harness"
HARNESS_COMMIT = "4dccbf1758270fbc822c80d00bbd9b39c811b532"
PROFILE_DIR = "mol_harness/Macaron-V1-Tall"
SLOTS = ("L0", "L1", "L2", "L3")
RANK = 64
CHUNK = 512


def peft_config(**overrides: object) -> bytes:
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": 128,
        "base_model_name_or_path": "Qwen/Qwen3.6-35B-A3B",
        "target_modules": ["up_proj", "v_proj"],
        **overrides,
    }
    return json.dumps(config, indent=2).encode()


def peft_weights(model, seed: int) -> bytes:
    """Rank-64 LoRA on layer 0's up and v projections of the tiny llama base (float32)."""
    rng = np.random.default_rng(seed)
    c = model.config
    prefix = "base_model.model.model.layers.0"
    shapes = {"mlp.up_proj": (c.n_ff, c.n_embd), "self_attn.v_proj": (c.n_head_kv * c.head_dim, c.n_embd)}
    tensors = {}
    for module, (out, inp) in shapes.items():
        tensors[f"{prefix}.{module}.lora_A.weight"] = rng.standard_normal((RANK, inp), dtype=np.float32) / 8
        tensors[f"{prefix}.{module}.lora_B.weight"] = rng.standard_normal((out, RANK), dtype=np.float32) / 8
    return save_safetensors(tensors)


@pytest.fixture
def published(tiny_model) -> dict[tuple[str, str], bytes]:
    """Tall's published file layout, with tiny bytes."""
    model = tiny_model("llama")
    files = {(BASE_REPO, BASE_FILE): model.path.read_bytes()}
    for i, slot in enumerate(SLOTS):
        files[(EXPERTS_REPO, f"loras/{slot}/adapter_config.json")] = peft_config()
        files[(EXPERTS_REPO, f"loras/{slot}/adapter_model.safetensors")] = peft_weights(model, seed=10 + i)
    return files


# Stand-ins for Mind Lab's files, in the shape the protocol reads (the real text is never in this repo).
_FAKE_SECTION = "## {x}\n\nadapter_name: {x}\n\n### Description\n\ntest expert {x}\n\n"
_FAKE_LORA = "".join(_FAKE_SECTION.format(x=x) for x in ("L0", "L1", "L2", "L3"))
PROFILE_TEXTS = {
    "route": b"test route instruction\n{{LORA_DESCRIPTIONS}}\nlabels: {{ROUTE_LABELS}}\n",
    "lora": _FAKE_LORA.encode(),
    "intro": b"test intro instruction\n",
    "summary": b"test summary instruction\n",
}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, published):
    with FakeHub(published) as fake:
        for role, text in PROFILE_TEXTS.items():
            fake.github_files[(HARNESS, HARNESS_COMMIT, f"{PROFILE_DIR}/{role}.md")] = text
        use_fake_hub(fake, monkeypatch, tmp_path / "hf-home")
        monkeypatch.setattr(secrets, "get_hf_token", lambda: None)
        monkeypatch.setattr(hf_constants, "DOWNLOAD_CHUNK_SIZE", CHUNK)
        yield fake


@pytest.fixture
def settings(home: Settings) -> Settings:
    return home  # conftest's isolated MACARON_HOME (subprocesses get it via run_cli's home=)


@pytest.fixture
def catalog(settings: Settings) -> Catalog:
    return Catalog(settings)


@pytest.fixture
def fake_tall(settings: Settings) -> Manifest:
    """The built-in Tall manifest unchanged (repos, paths, types, expectations, pinned commit),
    except: tiny size bounds, and the profile pins of the tests' own texts."""
    data = tomllib.loads((builtin_manifest_dir() / "tall.toml").read_text())
    data["name"] = "tall-fake"
    data["base"]["size"] = 10**6
    for entry in data["experts"].values():
        entry["size"] = 10**6
    for role, entry in data["profile"]["files"].items():
        entry["sha256"] = hashlib.sha256(PROFILE_TEXTS[role]).hexdigest()
        entry["size"] = len(PROFILE_TEXTS[role])
    settings.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    path = settings.user_manifests_dir / "tall-fake.toml"
    path.write_text(tomli_w.dumps(data))
    return Manifest.from_toml(path)


def expected_layout() -> list[tuple[str, str, str]]:
    rows = [("base", BASE_REPO, BASE_FILE)]
    for slot in SLOTS:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            rows.append(("expert", EXPERTS_REPO, f"loras/{slot}/{name}"))
    for role in ("route", "lora", "intro", "summary"):
        rows.append(("profile", HARNESS, f"{PROFILE_DIR}/{role}.md"))
    return rows


# --- the plan (--dry-run) ---------------------------------------------------------------------


def test_dry_run_prints_the_published_tall_layout_without_network(tmp_path):
    result = run_cli("models", "pull", "tall", "--dry-run", "--json", home=tmp_path / "home")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert [(f["role"], f["repo"], f["path"]) for f in plan["files"]] == expected_layout()
    hub_files = [f for f in plan["files"] if f["role"] != "profile"]
    assert all(f["size"] is None and f["revision"] == "main" for f in hub_files)
    assert plan["hub"]["reachable"] is False and "HF_HUB_OFFLINE" in plan["hub"]["error"]
    profiles = [f for f in plan["files"] if f["role"] == "profile"]
    assert all(f["revision"] == HARNESS_COMMIT and len(f["sha256"]) == 64 and f["size"] for f in profiles)
    assert profiles[0]["url"].endswith(f"/{HARNESS}/{HARNESS_COMMIT}/{PROFILE_DIR}/route.md")
    assert [(c["slot"], c["type"], c["expect_rank"], c["expect_base"]) for c in plan["convert"]] == [
        (slot, "Q8_0", 64, "Qwen3.6-35B-A3B") for slot in SLOTS
    ]
    # Without the hub, the totals are the manifest's bounds: about 22 GB + 38 GB (35 GiB).
    assert plan["total_bytes"] is None
    assert 59e9 < plan["bound_bytes"] < 61e9


def test_dry_run_fills_sizes_and_sha256_from_the_hub(hub, settings, published):
    result = run_cli("models", "pull", "tall", "--dry-run", "--json", home=settings.data_dir.parent, HF_HUB_OFFLINE="0")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    rows = {(f["repo"], f["path"]): f for f in plan["files"]}
    for key, data in published.items():
        assert rows[key]["size"] == len(data) and rows[key]["on_hub"] is True
        lfs = not key[1].endswith(".json")
        assert rows[key]["sha256"] == (hashlib.sha256(data).hexdigest() if lfs else None)
    assert plan["hub"]["reachable"] is True
    profile_bytes = sum(f["size"] for f in plan["files"] if f["role"] == "profile")
    assert plan["total_bytes"] == sum(len(d) for d in published.values()) + profile_bytes
    # Metadata only: one paths-info request per repository, no file content.
    assert sorted((r.method, r.path) for r in hub.requests) == sorted(
        [
            ("POST", f"/api/models/{BASE_REPO}/paths-info/main"),
            ("POST", f"/api/models/{EXPERTS_REPO}/paths-info/main"),
        ]
    )


def test_dry_run_says_which_published_file_is_missing(hub, catalog, published):
    del hub.files[(EXPERTS_REPO, "loras/L3/adapter_model.safetensors")]
    plan = plan_pull(catalog, catalog.get("tall"))
    assert [(f.path, f.on_hub) for f in plan.missing_on_hub] == [("loras/L3/adapter_model.safetensors", False)]
    result = run_cli(
        "models", "pull", "tall", "--dry-run", "--json", home=catalog.settings.data_dir.parent, HF_HUB_OFFLINE="0"
    )
    assert result.returncode == 1
    assert json.loads(result.stdout)["model"] == "tall"  # the plan is still printed
    assert result.stderr.strip() == f"error: not on the hub: {EXPERTS_REPO} loras/L3/adapter_model.safetensors"


# --- the real pull ----------------------------------------------------------------------------


def test_a_full_pull_of_fake_tall_converts_every_expert_to_q8_0(hub, catalog, fake_tall, published):
    result = pull(catalog, fake_tall, progress=False)

    base_path = catalog.base_path(fake_tall)
    assert base_path.read_bytes() == published[(BASE_REPO, BASE_FILE)]
    base = BaseModelInfo.from_gguf(base_path)
    for slot in SLOTS:
        out = catalog.expert_path(fake_tall, slot)
        info = validate_adapter(out, base)
        assert info.n_pairs == 2 and info.ranks == (RANK,) and info.task_name.startswith(slot)
        types = {t.tensor_type for t in gguf.GGUFReader(out).tensors}
        assert types == {gguf.GGMLQuantizationType.Q8_0}  # rank-64 rows fit Q8_0 blocks of 32
    assert result.files == [base_path] + [catalog.expert_path(fake_tall, s) for s in SLOTS]
    for role, text in PROFILE_TEXTS.items():
        assert catalog.profile_text(fake_tall, role) == text.decode()
    assert result.profiles == list(catalog.profile_paths(fake_tall).values())
    assert result.downloaded_bytes == sum(len(d) for d in published.values()) + sum(map(len, PROFILE_TEXTS.values()))

    hub.reset_counters()
    again = pull(catalog, fake_tall, progress=False)
    assert again.downloaded_bytes == 0 and hub.requests == []
    assert len(again.skipped) == 1 + 4 + 4  # base, experts, profile files


def test_a_pull_cut_off_in_an_expert_resumes_without_fetching_the_rest_again(hub, catalog, fake_tall, published):
    weights = published[(EXPERTS_REPO, "loras/L2/adapter_model.safetensors")]
    cut = 2 * CHUNK
    hub.cut_next_transfer(cut, then_go_down=True, only=weights)
    with pytest.raises(DownloadError, match="again to resume") as failure:
        pull(catalog, fake_tall, progress=False)
    assert "\n" not in str(failure.value)
    assert not catalog.expert_path(fake_tall, "L2").exists()

    hub.unavailable = False
    hub.reset_counters()
    result = pull(catalog, fake_tall, progress=False)

    cdn = hub.gets("cdn")
    assert [g.range for g in cdn] == [f"bytes={cut}-", None]  # the rest of L2, then L3's weights
    l3_weights = published[(EXPERTS_REPO, "loras/L3/adapter_model.safetensors")]
    assert result.downloaded_bytes == len(weights) - cut + len(l3_weights)
    base = BaseModelInfo.from_gguf(catalog.base_path(fake_tall))
    assert validate_adapter(catalog.expert_path(fake_tall, "L2"), base).ranks == (RANK,)


def test_an_expert_whose_bytes_do_not_match_the_hub_sha256_is_refused(hub, catalog, fake_tall, published):
    key = (EXPERTS_REPO, "loras/L1/adapter_model.safetensors")
    hub.corrupt[key] = bytes(len(published[key]))
    with pytest.raises(ModelError, match="sha256 .* does not match") as failure:
        pull(catalog, fake_tall, progress=False)
    assert "\n" not in str(failure.value)
    assert not catalog.expert_path(fake_tall, "L1").exists()
    assert not list((catalog.model_dir(fake_tall) / PULL_DIR).rglob("*.part"))  # nothing corrupt kept


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"r": 32}, "LoRA rank r is 32, expected 64"),
        (
            {"base_model_name_or_path": "meta-llama/Llama-3.1-8B"},
            "declares base 'meta-llama/Llama-3.1-8B', expected one whose name contains 'Qwen3.6-35B-A3B'",
        ),
    ],
)
def test_an_expert_for_another_rank_or_base_is_refused_before_any_large_file(hub, catalog, fake_tall, config, message):
    hub.files[(EXPERTS_REPO, "loras/L2/adapter_config.json")] = peft_config(**config)
    with pytest.raises(AdapterError) as failure:
        pull(catalog, fake_tall, progress=False)
    assert str(failure.value) == f"expert L2 Coding ({EXPERTS_REPO} loras/L2): {message}"
    assert hub.gets("cdn") == []  # neither the base nor any weights were fetched
    assert not (catalog.model_dir(fake_tall) / "loras/L2/adapter_config.json").exists()


def test_a_refused_expert_exits_2_with_one_line(hub, settings, fake_tall):
    hub.files[(EXPERTS_REPO, "loras/L0/adapter_config.json")] = peft_config(r=16)
    result = run_cli("models", "pull", "tall-fake", "-q", home=settings.data_dir.parent, HF_HUB_OFFLINE="0")
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: expert L0 Chat ({EXPERTS_REPO} loras/L0): LoRA rank r is 16, expected 64")


def test_a_profile_file_that_does_not_match_its_pin_is_refused(hub, catalog, fake_tall):
    hub.github_files[(HARNESS, HARNESS_COMMIT, f"{PROFILE_DIR}/intro.md")] = b"something else\n"
    with pytest.raises(ModelError, match="intro.md at 4dccbf175827: downloaded sha256 .* does not match"):
        pull(catalog, fake_tall, progress=False)
    assert not catalog.profile_path(fake_tall, "intro").exists()
    with pytest.raises(ModelError, match="is missing .*run `macaron models pull tall-fake`"):
        catalog.profile_text(fake_tall, "intro")


# --- profile locations ------------------------------------------------------------------------


def test_profiles_can_live_in_a_package_or_a_local_folder(settings, catalog, tmp_path):
    folder = tmp_path / "my-profile"
    folder.mkdir()
    (folder / "route.md").write_text("route here\n")
    manifests = {
        "pkg": {"source": "package", "package": "macaron_local", "files": {"intro": {"file": "errors.py"}}},
        "local": {"source": "path", "subfolder": str(folder), "files": {"route": {"file": "route.md"}}},
    }
    settings.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    for name, profile in manifests.items():
        data = {"name": name, "base": {"source": "path", "file": "/nowhere.gguf"}, "profile": profile}
        (settings.user_manifests_dir / f"{name}.toml").write_text(tomli_w.dumps(data))
    pkg, local = catalog.get("pkg"), catalog.get("local")
    assert catalog.profile_path(pkg, "intro") == Path(__import__("macaron_local").__file__).parent / "errors.py"
    assert "class MacaronError" in catalog.profile_text(pkg, "intro")
    assert catalog.profile_text(local, "route") == "route here\n"
    assert catalog.profile_path(local, "summary") is None
    assert catalog.profile_paths(catalog.get("embedded")) == {}


def test_a_github_profile_must_be_pinned(settings, catalog):
    data = {
        "name": "unpinned",
        "base": {"source": "path", "file": "/nowhere.gguf"},
        "profile": {"source": "github", "repo": HARNESS, "revision": "main", "files": {"route": {"file": "route.md"}}},
    }
    settings.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    (settings.user_manifests_dir / "unpinned.toml").write_text(tomli_w.dumps(data))
    with pytest.raises(Exception, match="must be pinned: repo, revision = a full commit"):
        catalog.get("unpinned")


def test_a_config_kept_in_git_is_checked_against_its_blob_id(hub, catalog, fake_tall, published):
    """adapter_config.json is not an LFS file: the hub's ETag is its git blob id, checked too."""
    key = (EXPERTS_REPO, "loras/L0/adapter_config.json")
    hub.corrupt[key] = published[key].replace(b"128", b"256")
    with pytest.raises(ModelError, match="git blob id .* does not match the hub's"):
        pull(catalog, fake_tall, progress=False)
    assert not (catalog.model_dir(fake_tall) / "loras/L0/adapter_config.json").exists()
    assert hub.gets("cdn") == []


def test_the_first_run_offer_states_the_whole_tall_download(hub, catalog, published):
    from macaron_ui.screens.first_run import tall_offer

    tall = catalog.get("tall")
    offline = plan_pull(catalog, tall, online=False)  # what the screen shows before any network
    text, fits = tall_offer(offline, free_bytes=100 * 10**9)
    assert text == "Tall: Qwen3.6-35B-A3B + 4 experts · download about 60 GB, needs 80 GB of disk (100 GB free)"
    assert fits and not tall_offer(offline, free_bytes=70 * 10**9)[1]
    assert hub.requests == []
    online = plan_pull(catalog, tall)  # once Tall is chosen: exact sizes from the (fake) hub
    assert online.total_bytes == sum(len(d) for d in published.values()) + sum(f.size for f in online.files[-4:])
    assert "download 0 GB" in tall_offer(online, free_bytes=100 * 10**9)[0]


def test_a_pulled_fake_tall_answers_through_llama_cpp_with_its_q8_0_experts(hub, catalog, fake_tall):
    pull(catalog, fake_tall, progress=False)
    catalog.settings.save(max_tokens=8)
    result = run_cli(
        "ask", "--model", "tall-fake", "--expert", "coding", "--json", "hi", home=catalog.settings.data_dir.parent
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert (answer["expert"], answer["adapters"]) == ("L2", ["L2.gguf"])
    assert answer["completion_tokens"] > 0


def test_the_trainer_checkpoint_is_the_base_folder_of_the_local_copy_and_never_downloaded(hub, catalog):
    from huggingface_hub import hf_hub_download

    tall = catalog.get("tall")
    assert (tall.trainer_checkpoint, tall.trainer_subfolder) == (EXPERTS_REPO, "base")
    with pytest.raises(ModelError, match=rf"download it once with `hf download {EXPERTS_REPO} --include 'base/\*'`"):
        catalog.trainer_checkpoint(tall)
    assert hub.requests == []  # looked in the local cache only

    hub.files[(EXPERTS_REPO, "base/config.json")] = b'{"model_type": "qwen3_5_moe"}'
    hf_hub_download(EXPERTS_REPO, "base/config.json")  # what `hf download --include` leaves in the cache
    hub.reset_counters()
    folder = Path(catalog.trainer_checkpoint(tall))
    assert folder.name == "base" and json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5_moe"
    assert hub.requests == []
