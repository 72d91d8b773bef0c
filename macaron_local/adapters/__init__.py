"""Adapter IO: the only code that writes GGUF LoRA files or decides to trust one."""

from macaron_local.adapters.gguf_lora import (
    STORAGE_TYPES,
    LoraAdapter,
    LoraPair,
    permute_llama_qk_rows,
    read_adapter,
    write_adapter,
)
from macaron_local.adapters.validate import AdapterReport, BaseModelInfo, validate_adapter

__all__ = [
    "STORAGE_TYPES",
    "AdapterReport",
    "BaseModelInfo",
    "LoraAdapter",
    "LoraPair",
    "permute_llama_qk_rows",
    "read_adapter",
    "validate_adapter",
    "write_adapter",
]
