"""Remote engines: the in-process engine's interface over llama-server or vLLM."""
