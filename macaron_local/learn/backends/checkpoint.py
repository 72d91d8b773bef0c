"""Where a trainer finds the base checkpoint the manifest names, and how it loads it.

One place resolves `[training] checkpoint`: a local directory is used as is; a Hugging Face repo
id is looked up in the local cache only (learning never downloads; the user fetches it once with
`hf download`). The same place decides whether a CUDA GPU needs the base loaded in 8 or 4 bits
(bitsandbytes): BF16 weights that do not fit beside the trainer's working memory are quantized,
as QLoRA does; the LoRA itself stays in full precision.
"""

from __future__ import annotations

from pathlib import Path

from macaron_local.errors import MacaronError

#: Memory the trainer needs beyond the base weights on the GPU (activations of one short
#: sequence, LoRA + AdamW state, CUDA context), as a fraction of the BF16 weights' size, plus a
#: fixed allowance. Planning figures, not measurements.
TRAINING_HEADROOM_FRACTION = 0.10
TRAINING_HEADROOM_BYTES = 3 * 1024**3
#: Bytes per parameter of each load, relative to BF16's 2 (bitsandbytes int8 and NF4 with
#: double quantization keep a little per-block state).
BITS_FACTOR = {None: 1.0, "8bit": 0.53, "4bit": 0.29}


def resolve_checkpoint(checkpoint: str | Path) -> Path:
    """A local directory holding `config.json`: the path itself, or the local cache's snapshot
    of a repo id. Raises a one-line MacaronError when it is not on this machine."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise MacaronError(f"trainer checkpoint {path} has no config.json")
        return path
    if path.is_absolute() or str(checkpoint).startswith((".", "~")):
        raise MacaronError(f"trainer checkpoint {checkpoint} does not exist")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(checkpoint), local_files_only=True))
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise MacaronError(
            f"the trainer needs {checkpoint} on this machine; download it once with `hf download {checkpoint}`"
        ) from None


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the checkpoint's safetensors weights (as stored: BF16 for Tall's `base/`)."""
    return sum(p.stat().st_size for p in Path(directory).glob("*.safetensors"))


def choose_quantization(bf16_bytes: int, gpu_bytes: int | None) -> str | None:
    """None (BF16), "8bit" or "4bit": the widest load whose weights plus headroom fit the GPU.
    No GPU (CPU or MLX): None. Raises when even 4 bits do not fit."""
    if gpu_bytes is None:
        return None
    headroom = TRAINING_HEADROOM_BYTES + TRAINING_HEADROOM_FRACTION * bf16_bytes
    for bits in (None, "8bit", "4bit"):
        if bf16_bytes * BITS_FACTOR[bits] + headroom <= gpu_bytes:
            return bits
    need = bf16_bytes * BITS_FACTOR["4bit"] + headroom
    raise MacaronError(
        f"the base needs about {need / 1024**3:.0f} GiB of GPU memory to train even in 4 bits; "
        f"this GPU has {gpu_bytes / 1024**3:.0f} GiB (use a remote trainer)"
    )


def bitsandbytes_config(bits: str, torch):
    """transformers' quantization config for `bits` (NF4 with BF16 compute, or int8)."""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except ImportError:
        raise MacaronError(
            f"loading the base in {bits} needs bitsandbytes: pip install 'macaron-local[cuda]'"
        ) from None
    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
