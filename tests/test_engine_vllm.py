"""The vLLM engine's requests and parsing, and the exact PEFT stack it serves an expert plus the
user's adapter as. vLLM itself needs an NVIDIA GPU, which this machine lacks: what is checked
here is everything on this side of the HTTP boundary (what is sent, how answers are read),
against the request and response shapes of vLLM's OpenAI-compatible server."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from macaron_local.adapters.peft import SafetensorsFile
from macaron_local.adapters.peft_stack import stack_peft
from macaron_local.engine import GenerationParams
from macaron_local.engine.remote.vllm import (
    choice_request,
    completion_request,
    peft_folder,
    render_request,
    scored_logprobs,
    scoring_request,
    stream_piece,
)
from macaron_local.errors import AdapterError, MacaronError


def test_a_greedy_completion_request_names_the_expert_and_sends_token_ids():
    body = completion_request("L2", [1, 2, 3], GenerationParams(max_tokens=7, temperature=0.0), seed=5)
    assert body["model"] == "L2" and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.0, -1, 1.0, 0.0)
    assert body["stream"] and body["return_token_ids"] and body["seed"] == 5
    assert "structured_outputs" not in body
    sampled = completion_request("L0", [1], GenerationParams(temperature=0.7, top_k=20, grammar='root ::= "a"'), 0)
    assert (sampled["top_k"], sampled["structured_outputs"]) == (20, {"grammar": 'root ::= "a"'})
    json.dumps(sampled)  # what is sent is plain JSON


def test_scoring_is_teacher_forced_through_prompt_logprobs():
    body = scoring_request("macaron-abc", [1, 2], [3, 4])
    assert body["prompt"] == [1, 2, 3, 4] and body["prompt_logprobs"] == 0 and body["max_tokens"] == 1
    response = {
        "choices": [
            {
                "text": "x",
                "prompt_logprobs": [
                    None,
                    {"2": {"logprob": -1.5, "rank": 3, "decoded_token": "b"}},
                    {"3": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}},
                    {"4": {"logprob": -7.0, "rank": 90, "decoded_token": "d"}, "9": {"logprob": -0.1, "rank": 1}},
                ],
            }
        ]
    }
    assert scored_logprobs(response, 2, [3, 4]) == [-0.25, -7.0]
    with pytest.raises(MacaronError, match="did not score token 5"):
        scored_logprobs(response, 2, [3, 5])


def test_stream_chunks_drop_the_end_token_but_keep_a_stop_strings_tokens():
    piece = stream_piece({"choices": [{"text": "", "token_ids": [7, 2], "finish_reason": "stop", "stop_reason": None}]})
    assert (piece.tokens, piece.stop_token, piece.finish) == ([7], 2, "stop")
    worded = stream_piece(
        {"choices": [{"text": "ab", "token_ids": [5, 6], "finish_reason": "stop", "stop_reason": "\n"}]}
    )
    assert (worded.tokens, worded.stop_token, worded.text) == ([5, 6], None, "ab")
    running = stream_piece({"choices": [{"text": "a", "token_ids": [5], "finish_reason": None}]})
    assert (running.tokens, running.finish) == ([5], "")
    assert stream_piece({"choices": [{"text": "", "token_ids": [], "finish_reason": "length"}]}).finish == "length"


def test_the_route_choice_and_the_rendering_requests():
    body = choice_request("L0", [1, 2], [40, 41, 40, 42])
    assert body["allowed_token_ids"] == [40, 41, 42] and body["max_tokens"] == 1 and body["temperature"] == 0.0
    rendered = render_request("base", [{"role": "user", "content": "hi"}], True, False, {"enable_thinking": False})
    assert rendered["add_generation_prompt"] and not rendered["continue_final_message"]
    assert rendered["chat_template_kwargs"] == {"enable_thinking": False}
    prefill = render_request("base", [{"role": "assistant", "content": "model_id="}], True, True, {})
    assert not prefill["add_generation_prompt"] and prefill["continue_final_message"]


# ----------------------------------------------------------------- the exact stack
def write_peft(folder: Path, modules: dict[str, tuple[int, int]], rank: int, alpha: float, seed: int, **extra) -> Path:
    rng = np.random.default_rng(seed)
    tensors = {}
    for module, (out_features, in_features) in modules.items():
        prefix = f"base_model.model.{module}"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(size=(rank, in_features)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(size=(out_features, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": ["q_proj", "v_proj"], **extra}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def delta(folder: Path, module: str) -> np.ndarray:
    weights = SafetensorsFile(folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    prefix = f"base_model.model.{module}"
    a, b = weights.read(f"{prefix}.lora_A.weight"), weights.read(f"{prefix}.lora_B.weight")
    scale = config["lora_alpha"] / (np.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
    return scale * (b.astype(np.float64) @ a.astype(np.float64))


def test_a_stack_is_exactly_the_sum_of_its_adapters(tmp_path):
    q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    expert = write_peft(tmp_path / "L0", {q: (16, 12), v: (8, 12)}, rank=4, alpha=8, seed=1)
    personal = write_peft(tmp_path / "mine", {q: (16, 12)}, rank=2, alpha=4, seed=2, use_rslora=True)
    stacked = stack_peft([(expert, 1.0), (personal, 0.5)], tmp_path / "stack.peft")
    config = json.loads((stacked / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (6, 6, False)
    assert np.allclose(delta(stacked, q), delta(expert, q) + 0.5 * delta(personal, q), atol=1e-4)
    assert np.allclose(delta(stacked, v), delta(expert, v), atol=1e-4)  # the personal one lacks v: zero rows
    again = stack_peft([(expert, 1.0)], tmp_path / "stack.peft")  # replaced whole, atomically
    assert np.allclose(delta(again, q), delta(expert, q), atol=1e-4)


def test_a_stack_refuses_what_it_cannot_add_exactly(tmp_path):
    q = "model.layers.0.self_attn.q_proj"
    small = write_peft(tmp_path / "a", {q: (16, 12)}, rank=4, alpha=8, seed=1)
    other = write_peft(tmp_path / "b", {q: (10, 12)}, rank=4, alpha=8, seed=2)
    with pytest.raises(AdapterError, match="disagree on its shape"):
        stack_peft([(small, 1.0), (other, 1.0)], tmp_path / "out")
    (tmp_path / "half").mkdir()
    save_file(
        {f"base_model.model.{q}.lora_A.weight": np.zeros((4, 12), np.float32)},
        str(tmp_path / "half" / "adapter_model.safetensors"),
    )
    (tmp_path / "half" / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(AdapterError, match="half a LoRA pair"):
        stack_peft([(tmp_path / "half", 1.0)], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_gguf_adapter_is_served_from_its_peft_export(tmp_path):
    assert peft_folder(tmp_path / "personal-3.gguf") == tmp_path / "personal-3.peft"
    (tmp_path / "dir").mkdir()
    assert peft_folder(tmp_path / "dir") == tmp_path / "dir"


# ----------------------------------------------------------------- the stack's lifecycle
class AdminServer:
    """vLLM's model list and runtime adapter endpoints as its server answers them (load and
    unload reply in plain text), on 127.0.0.1. vLLM itself cannot run here (no NVIDIA GPU)."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.requests: list[tuple[str, dict]] = []
        self.models = ["base", "L0"]
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                data = [{"id": m, "parent": None if m == "base" else "base"} for m in outer.models]
                self._send(json.dumps({"object": "list", "data": data}).encode(), "application/json")

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append((self.path, body))
                if self.path == "/v1/completions":  # the route hop's one-token choice
                    choice = {"text": "", "token_ids": [body["allowed_token_ids"][0]]}
                    self._send(json.dumps({"choices": [choice]}).encode(), "application/json")
                else:
                    verb = "added" if "load_lora" in self.path else "removed"
                    self._send(
                        f"Success: LoRA adapter '{body['lora_name']}' {verb} successfully.".encode(), "text/plain"
                    )

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_stack_holding_the_users_weights_is_deleted_when_they_are_unloaded(tmp_path):
    import hashlib
    import os

    from macaron_local.engine import EngineConfig
    from macaron_local.engine.remote.vllm import VllmEngine
    from macaron_local.store.adapter_files import remove_companion

    q = "model.layers.0.self_attn.q_proj"
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    gguf = b"a registered personal adapter"
    digest = hashlib.sha256(gguf).hexdigest()
    (adapters / f"{digest}.gguf").write_bytes(gguf)
    write_peft(adapters / f"{digest}.peft", {q: (16, 12)}, rank=2, alpha=4, seed=2)  # its companion
    expert = write_peft(tmp_path / "models" / "L0", {q: (16, 12)}, rank=4, alpha=8, seed=1)
    server = AdminServer()
    try:
        engine = VllmEngine(EngineConfig(model_path=tmp_path / "absent.gguf"), url=server.url)
        l0 = engine.load_adapter(expert, name="L0")  # registered at the server's start: nothing sent
        personal = engine.load_adapter(adapters / f"{digest}.gguf")
        loaded = {"lora_name": f"macaron-{personal.key}", "lora_path": str(adapters / f"{digest}.peft")}
        assert server.requests == [("/v1/load_lora_adapter", loaded)]  # served from its companion
        engine.set_adapters([l0, personal])
        assert engine.best_next([1, 2], [7, 8]) == 7
        path, load = server.requests[1]
        stack = Path(load["lora_path"])
        assert path == "/v1/load_lora_adapter" and server.requests[2][1]["model"] == load["lora_name"]
        assert stack.parent == adapters and stack.name.startswith(f".stack-{os.getpid()}-")
        assert np.allclose(delta(stack, q), delta(expert, q) + delta(adapters / f"{digest}.peft", q), atol=1e-4)

        engine.set_adapters([])
        engine.unload_adapter(personal)  # e.g. a forget withdrew the version
        assert not stack.exists()
        assert [p for p, _ in server.requests[3:]] == ["/v1/unload_lora_adapter"] * 2  # the stack, then it
        engine.close()
    finally:
        server.close()
    # A stack a crashed process left is collected, and a forget removes every stack of its version.
    left = adapters / f".stack-999999999-macaron-{digest[:16]}x1+dir-L0x1.peft"
    left.mkdir()
    remove_companion(adapters, digest)
    assert not left.exists() and not (adapters / f"{digest}.peft").exists()
