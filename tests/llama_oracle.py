"""The final judge of an adapter our validator accepted: does llama.cpp itself load it?

`python tests/llama_oracle.py BASE.gguf ADAPTER...` loads the base once, then each adapter with
`llama_adapter_lora_init`, and prints one JSON object {adapter: true (loaded) | false (refused)}.
A crash kills the process (the caller sees a signal and no JSON): that is the finding.
"""

from __future__ import annotations

import json
import sys


def main(base: str, adapters: list[str]) -> None:
    import llama_cpp

    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(base.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load the base {base}")
    loaded = {}
    for path in adapters:
        pointer = llama_cpp.llama_adapter_lora_init(model, path.encode())
        loaded[path] = bool(pointer)
        if pointer:
            llama_cpp.llama_adapter_lora_free(pointer)
    sys.stdout.write(json.dumps(loaded))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
