"""Why `macaron_local.download` streams files itself instead of calling `hf_hub_download`.

A pull of Tall moves about 60 GB; one that dies part-way (the network drops for longer than
huggingface_hub's own few retries, the laptop sleeps, the user presses Ctrl-C) must not start
again from zero. Both paths below download the same LFS file from the tests' fake hub (real HTTP
on 127.0.0.1), the connection is cut halfway and the hub stays down, so the first attempt fails;
then the hub comes back and each path is run again. The figure is the bytes the second attempt
fetched: `hf_hub_download` (huggingface_hub's downloader, which writes to a per-process temp file
and deletes it on failure) against `macaron_local.download.pull` (which keeps an ETag-named
partial file and resumes it with a Range request), in the same run.

    python bench/hf_resume.py [--json] [--mb 8]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import tomli_w

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from common import emit  # noqa: E402
from fake_hub import FakeHub, use_fake_hub  # noqa: E402

REPO, FILE = "bench-org/bench-GGUF", "bench.gguf"


def build_gguf(path: Path, megabytes: int) -> bytes:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(64)
    writer.add_tensor("token_embd.weight", rng.standard_normal((megabytes * 4096, 64), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def second_attempt_bytes(hub: FakeHub, data: bytes, attempt) -> tuple[int, bool]:
    """Cut the first attempt halfway with the hub staying down; return what the second one
    fetched and whether it produced the right bytes."""
    hub.unavailable = False
    hub.reset_counters()
    hub.cut_next_transfer(len(data) // 2, then_go_down=True)
    with contextlib.suppress(Exception):  # the first attempt is meant to fail
        attempt()
    hub.unavailable = False
    hub.reset_counters()
    path = attempt()
    return hub.bytes_served, Path(path).read_bytes() == data


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--mb", type=int, default=8, help="file size in MB")
    args = parser.parse_args()

    import huggingface_hub
    from huggingface_hub import constants, hf_hub_download

    from macaron_local import secrets
    from macaron_local.catalog import Catalog, Manifest
    from macaron_local.download import pull
    from macaron_local.settings import Settings

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        root = Path(tmp)
        data = build_gguf(root / FILE, args.mb)
        with FakeHub({(REPO, FILE): data}) as hub:
            use_fake_hub(hub, mp, root / "hf-home")
            mp.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
            mp.setattr(secrets, "get_hf_token", lambda: None)

            def with_hf() -> str:
                return hf_hub_download(REPO, FILE, local_dir=root / "hf")

            settings = Settings.load(root / "home")
            settings.ensure_dirs()
            settings.user_manifests_dir.mkdir(parents=True, exist_ok=True)
            manifest_path = settings.user_manifests_dir / "bench.toml"
            manifest_path.write_text(
                tomli_w.dumps({"name": "bench", "base": {"source": "huggingface", "repo": REPO, "file": FILE}})
            )
            catalog = Catalog(settings)

            def with_pull() -> Path:
                return pull(catalog, Manifest.from_toml(manifest_path), progress=False).files[0]

            hf_bytes, hf_ok = second_attempt_bytes(hub, data, with_hf)
            ours_bytes, ours_ok = second_attempt_bytes(hub, data, with_pull)

    return emit(
        {
            "huggingface_hub": huggingface_hub.__version__,
            "file_bytes": len(data),
            "cut_at_bytes": len(data) // 2,
            "hf_hub_download_second_attempt_bytes": hf_bytes,
            "macaron_pull_second_attempt_bytes": ours_bytes,
            "refetch_ratio_hf_over_macaron": round(hf_bytes / max(ours_bytes, 1), 2),
            "both_correct": hf_ok and ours_ok,
        },
        args.json,
    )


if __name__ == "__main__":
    raise SystemExit(main())
