"""Writing an adapter onto a disk that fills up is one clear error and leaves nothing behind.
The limit is a real one: the kernel's file-size limit (RLIMIT_FSIZE) makes writes fail with
EFBIG exactly as a full disk fails them with ENOSPC."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import write_random_adapter

CHILD = textwrap.dedent(
    """
    import resource, signal, sys
    from macaron_local.adapters import read_adapter, write_adapter
    from macaron_local.errors import MacaronError
    adapter = read_adapter(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    try:
        write_adapter(sys.argv[2], adapter)
    except MacaronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    """
)


def test_a_write_past_the_limit_is_one_clear_error_and_no_partial_file(tmp_path, tiny_model):
    source = write_random_adapter(tmp_path / "source.gguf", tiny_model("llama", False), rank=8, seed=1)
    assert source.stat().st_size > 4096
    target = tmp_path / "full"
    target.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), str(target / "out.gguf")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr  # not bad input: the machine is out of space
    assert done.stderr.startswith("error: no space left to write out.gguf") and "Traceback" not in done.stderr
    assert list(target.iterdir()) == []  # neither the file nor its temp file
