"""The inference engine: llama.cpp with validated, hot-swappable LoRA adapters."""

from macaron_local.engine.llama_engine import (
    AdapterHandle,
    Completion,
    Engine,
    EngineConfig,
    Generation,
    GenerationParams,
)
from macaron_local.engine.template import ChatTemplate, ContextOverflowError, fit_messages

__all__ = [
    "AdapterHandle",
    "ChatTemplate",
    "Completion",
    "ContextOverflowError",
    "Engine",
    "EngineConfig",
    "Generation",
    "GenerationParams",
    "fit_messages",
]
