"""Measurement layer: FLOP ledger vs FlopCounterMode on the real model, MFU, NVML, memory."""

from __future__ import annotations

import time
import types

import pytest
import torch

from tests.helpers.ledger_shared import TOL, check, rel
from tsync_mcore.observability.ledger import (
    FlopBreakdown,
    MemoryMeter,
    NvmlSampler,
    detect_peak,
    forward_flops,
    load_spec,
    mfu_active,
    replay_flops,
    span_flops,
    steady_state,
    train_flops,
)
from tsync_mcore.observability.ledger import mfu as mfu_mod

SEQ_LENS = [[7], [64], [23, 100]]


@pytest.mark.parametrize("name", ["qwen2", "llama", "qwen3", "qwen3_tied"])
def test_train_flops_match_counter_tp1(name, tiny_ckpts, parallel1):
    from tests.helpers.workers.ledger_worker import measure_cases

    results = measure_cases(tiny_ckpts[name], SEQ_LENS)
    assert {r["case"] for r in results} == {"none", "linear_but_one", "all_but_one"}
    check(results, load_spec(tiny_ckpts[name]), tp=1)
    # frozen weights really change the count (input-grad only / no grad at all)
    by = {(r["case"], tuple(r["seq_lens"])): r["total"] for r in results}
    assert by[("all_but_one", (64,))] < by[("linear_but_one", (64,))] < by[("none", (64,))]


def test_span_and_replay_match_counter(tiny_qwen3, parallel1):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    from torch.utils.flop_counter import FlopCounterMode

    from tsync_mcore.model import bridge, span

    model, spec = bridge.build_model(tiny_qwen3)
    P, n = 21, 13
    toks = torch.randint(0, spec.vocab_size, (P + n,), generator=torch.Generator().manual_seed(3))
    _, kv0 = span.span_forward(model, toks[:P], 0, None, want_logits=False)
    past = span.detached_leaves(kv0)
    with FlopCounterMode(display=False) as fc:  # an OPD turn: n tokens against P context
        lg, kv1 = span.span_forward(model, toks[P:], P, past)
        fwd = fc.get_total_flops()
        vocab_parallel_cross_entropy(lg.float()[None], toks[P:][None]).sum().backward()
    b = span_flops(spec, n, P)
    assert rel(b.forward, fwd) < TOL and rel(b.total, fc.get_total_flops()) < TOL
    with FlopCounterMode(display=False) as fc:  # its deferred replay (recompute mode)
        _, kv = span.span_forward(model, toks[P:], P, past, stop_after_kv=True)
        rec = fc.get_total_flops()
        span.backward_kv(kv, [(torch.randn_like(x.k), torch.randn_like(x.v)) for x in kv])
    r = replay_flops(spec, n, P)
    assert r.forward == 0 and r.total == r.backward  # recomputation is not credited
    assert rel(r.recompute_flops, rec) < TOL
    assert rel(r.backward, fc.get_total_flops() - rec) < TOL
    assert replay_flops(spec, n, P, mode="retain").recompute_flops == 0


def test_ledger_shapes_and_options(tiny_qwen3):
    spec = load_spec(tiny_qwen3)
    h, hd, heads, kv, ffn, V, L = (spec.hidden, spec.head_dim, spec.heads, spec.kv_heads,
                                   spec.ffn, spec.vocab_size, spec.layers)  # fmt: skip
    assert hd * heads != h  # Qwen3 shapes: head_dim != hidden / heads
    s = 50
    per_layer = 2 * s * h * (heads + 2 * kv) * hd + 2 * s * heads * hd * h + 3 * 2 * s * h * ffn
    attn = 2 * 2 * heads * hd * s * s
    full = L * (per_layer + attn) + 2 * s * h * V
    assert forward_flops(spec, [s]) == full
    assert train_flops(spec, [s]).total == 3 * full  # nothing frozen: backward = 2x forward
    causal = forward_flops(spec, [s], attention="causal")
    assert full - causal == L * 2 * 2 * heads * hd * (s * s - s * (s + 1) // 2)
    assert forward_flops(spec, [s], logits_positions=[10]) == full - 2 * 40 * h * V
    # sum over sequences of s_i^2, not (sum s_i)^2
    assert forward_flops(spec, [20, 30]) == forward_flops(spec, [20]) + forward_flops(spec, [30])
    # a span at offset 0 is the sequence; context only adds attention pairs
    assert span_flops(spec, s, 0).to_dict() == train_flops(spec, [s]).to_dict()
    d = span_flops(spec, 10, 40).forward - span_flops(spec, 10, 0).forward
    assert d == L * 2 * 2 * heads * hd * 10 * 40
    # components add up (LoRA: tests/test_ledger_lora.py)
    b = train_flops(spec, [s])
    assert sum(c["forward"] for c in b.by_component.values()) == b.forward
    # TP split is exact; a shape that cannot be split is an error
    assert train_flops(spec, [s]).per_rank(2).total * 2 == b.total
    with pytest.raises(ValueError):
        forward_flops(spec, [s], attention="sliding")
    with pytest.raises(ValueError):
        FlopBreakdown(3, 0).per_rank(2)


def test_mfu_arithmetic():
    assert mfu_active(4.5e15, 2.0, 8, 2250e12) == pytest.approx(4.5e15 / (2.0 * 8 * 2250e12))
    assert mfu_active(1e12, 1.0, 1, detect_peak(500.0)) == pytest.approx(0.002)
    assert steady_state([9.0, 9.0, 9.0, 9.0, 1.0, 3.0]) == 2.0  # first 4 discarded
    assert mfu_mod.steady_state_mfu([2e12] * 3, [1.0, 2.0, 4.0], 2, 1e12, warmup=1) == \
        pytest.approx((0.5 + 0.25) / 2)  # fmt: skip
    with pytest.raises(ValueError):
        steady_state([1.0, 2.0], warmup=2)
    with pytest.raises(ValueError):
        mfu_active(1.0, 0.0, 1, 1.0)


def test_peak_table_and_overrides(monkeypatch):
    look = mfu_mod._table_lookup
    assert look("NVIDIA B200", mfu_mod.PEAK_TFLOPS) == ("B200", 2250.0)
    assert look("NVIDIA H200", mfu_mod.PEAK_TFLOPS) == ("H200", 989.5)
    assert look("NVIDIA H100 80GB HBM3", mfu_mod.PEAK_TFLOPS) == ("H100", 989.5)
    assert look("NVIDIA H100 PCIe", mfu_mod.PEAK_TFLOPS)[0] == "H100 PCIE"
    assert look("Tesla T4", mfu_mod.PEAK_TFLOPS) is None
    p = detect_peak(123.0)
    assert p.flops_per_s == 123e12 and p.source == "config"
    monkeypatch.setenv(mfu_mod.PEAK_ENV, "42.5")
    assert detect_peak().flops_per_s == 42.5e12 and detect_peak().source.startswith("env:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU peak path")
def test_cpu_peak_measured_and_cached(monkeypatch):
    monkeypatch.delenv(mfu_mod.PEAK_ENV, raising=False)
    p = detect_peak()
    assert p.source == "measured-cpu-matmul" and p.flops_per_s > 1e8
    t0 = time.perf_counter()
    assert detect_peak() is p  # cached per process: no second benchmark
    assert time.perf_counter() - t0 < 0.05
    assert p.to_dict()["peak_source"] == "measured-cpu-matmul"


@pytest.mark.skipif(torch.cuda.is_available(), reason="no-GPU path")
def test_nvml_disabled_cleanly():
    s = NvmlSampler(interval_s=0.01)
    assert not s.enabled and s.reason  # e.g. "NVMLError_LibraryNotFound: ..."
    with s:
        time.sleep(0.02)
    summ = s.summary()
    assert summ["enabled"] is False and summ["reason"] == s.reason
    assert summ["devices"] == {} and summ["energy_j"] is None and s.timeline() == []


def _fake_nvml() -> types.SimpleNamespace:
    """A pynvml stand-in: two devices, energy rising 1 J per reading."""
    state = {"e": 0}

    def energy(h):
        state["e"] += 1000
        return state["e"]

    def handle(uuid):
        if not uuid.startswith("GPU-"):
            raise RuntimeError("bad uuid")
        return uuid

    return types.SimpleNamespace(
        NVML_CLOCK_SM=1,
        nvmlDeviceGetHandleByUUID=handle,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=50, memory=20),
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=2**30),
        nvmlDeviceGetPowerUsage=lambda h: 300_000,
        nvmlDeviceGetClockInfo=lambda h, c: 1980,
        nvmlDeviceGetTotalEnergyConsumption=energy,
    )


def test_nvml_sampler_timeline_with_fake_backend():
    s = NvmlSampler(uuids=["GPU-a", "GPU-b"], interval_s=0.005, nvml=_fake_nvml())
    assert s.enabled and s.reason is None
    t0_perf, t0_wall = time.perf_counter(), time.time()
    with s:
        time.sleep(0.05)
    rows = s.timeline()
    assert len(rows) >= 4 and {r["device"] for r in rows} == {"0", "1"}
    assert all(r["t_perf"] >= t0_perf and abs(r["t_wall"] - t0_wall) < 5 for r in rows)
    summ = s.summary()
    d = summ["devices"]["0"]
    assert d["uuid"] == "GPU-a" and d["util_gpu_mean"] == 50 and d["power_w_max"] == 300.0
    assert d["sm_clock_mhz_mean"] == 1980 and d["mem_used_bytes_max"] == 2**30
    assert d["energy_j"] > 0 and summ["energy_j"] >= d["energy_j"]
    bad = NvmlSampler(uuids=["nope"], nvml=_fake_nvml())
    assert not bad.enabled and "bad uuid" in bad.reason


def test_memory_snapshot_fields():
    m = MemoryMeter()
    m.reset_after_setup()
    junk = torch.ones(4 * 2**20)  # 16 MiB resident
    snap = m.snapshot(host_accum_bytes=123)
    del junk
    assert snap["peak_mem_bytes"] > 0 and snap["host_accum_bytes"] == 123
    assert snap["setup_bytes"] is not None and snap["peak_source"]
    if torch.cuda.is_available():
        assert {"reserved_bytes", "nvml_used_bytes", "allocated_bytes"} <= set(snap)
    else:
        assert snap["backend"] == "cpu"
        assert snap["peak_mem_bytes"] >= snap["rss_bytes"] > 16 * 2**20
