"""The Tall fit arithmetic, checked against shapes worked out by hand, and doctor's one line."""

from __future__ import annotations

import json

from conftest import run_cli

from macaron_local import fit


def test_expert_size_follows_the_published_shapes():
    s = fit.TallShapes()
    # By hand: routed experts per layer are gate and up (A 256x64x2048, B 256x512x64 each) and
    # down (A 256x64x512, B 256x2048x64); the packed PEFT gate_up A appears twice in GGUF.
    experts = 40 * (2 * (256 * 64 * 2048 + 256 * 512 * 64) + 256 * 64 * 512 + 256 * 2048 * 64)
    assert experts == 40 * 125_829_120
    assert experts < fit.expert_parameters() < experts * 1.05  # attention, linear attention, shared: small
    assert fit.expert_bytes("F32") == 4 * fit.expert_parameters()
    assert fit.expert_bytes("F16") == 2 * fit.expert_parameters()
    assert fit.expert_bytes("Q8_0") == fit.expert_parameters() // 32 * 34  # every row is whole blocks
    assert fit.expert_bytes("Q4_0") < fit.expert_bytes("Q5_0") < fit.expert_bytes("Q8_0")
    assert s.rank == 64


def test_experts_that_fit_and_the_verdict_line():
    one = fit.expert_bytes(fit.TALL_EXPERT_TYPE)
    floor = fit.BASE_Q4_K_M_BYTES + fit.RUNTIME_OVERHEAD_BYTES
    assert fit.experts_that_fit(floor + one - 1) == 0
    assert fit.experts_that_fit(floor + 2 * one) == 2
    assert fit.experts_that_fit(floor + 10 * one) == 4
    ok, line = fit.verdict(floor + 2 * one, disk_free_bytes=10**12)
    assert ok and "2 of 4 experts resident" in line
    ok, line = fit.verdict(16 * 10**9, disk_free_bytes=None)
    assert not ok and line.startswith("Tall does not fit: 16 GB RAM")
    ok, line = fit.verdict(10**12, disk_free_bytes=10**9)
    assert not ok and "not on disk" in line and "1 GB of disk free, its installed files take" in line


def test_doctor_says_whether_tall_fits(tmp_path):
    done = run_cli("doctor", "--json", home=tmp_path / "home")
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["tall fit"]["detail"].startswith(("Tall fits", "Tall does not fit", "Tall fits in RAM"))
    assert checks["tall fit"]["ok"]  # informational unless Tall is the model being served
