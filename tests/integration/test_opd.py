"""OPD per-turn streaming with deferred context replay, through the replay command."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.helpers.batchgen import write_opd_batches
from tests.helpers.dist_util import parse_results
from tests.helpers.paths import ROOT
from tests.helpers.reference import reference_opd_grad, rel_l2
from tests.helpers.replay import replay_many
from tsync_mcore.observability import trace
from tsync_mcore.observability.trace import DeferredRecord

N_UPDATES = 10


@pytest.fixture(scope="module")
def action_first_batch(tmp_path_factory):
    """"Action, then its observation": every turn but the first starts with a scored token
    (rows, file)."""
    from tests.helpers.batchgen import action_first, make_opd_batch
    rows = action_first(make_opd_batch(256, n_traj=4, turns=3, seed=9, zero_scored_traj=False))
    af = str(tmp_path_factory.mktemp("action_first") / "action_first.jsonl")
    _write(af, rows)
    return rows, af


@pytest.fixture(scope="module")
def opd_runs(tiny_qwen2, tiny_ckpts, action_first_batch, tmp_path_factory):
    d = tmp_path_factory.mktemp("opd")
    batch, tp2_batch = str(d / "batch.jsonl"), str(d / "tp2.jsonl")
    rows = write_opd_batches(batch, 256, n_updates=N_UPDATES, seed=2, turns=4)
    tp2_rows = write_opd_batches(tp2_batch, 256, n_updates=1, seed=8, turns=3)
    common = ["--model", tiny_qwen2, "--batch", batch, "--objective", "opd", "--lr", "1e-5",
              "--save-grads", "all"]
    jobs = {  # one torchrun launch (each job its own Policy/Learner, see replay_many)
        # fp64: arrival-order independence, which needs one turn per pass (a packed pass's
        # FP32 gradient depends on its company; docs/design/numerics.md)
        "sync": ["--schedule", "sync", "--accum-dtype", "fp64", "--max-tokens-per-pass", "0"],
        "thundersync": ["--schedule", "thundersync", "--accum-dtype", "fp64",
                        "--max-tokens-per-pass", "0"],
        "thundersync_fp32": ["--schedule", "thundersync"],
        "sync_fp32": ["--schedule", "sync"],
        "retain": ["--schedule", "thundersync", "--opd-replay", "retain"],
    }
    jobs = {name: [*common, *flags] for name, flags in jobs.items()}
    # the TP = 2 replay on Qwen3 (test_opd_tensor_parallel_two_ranks_vs_reference) and the
    # action-first batch's sync and thundersync (test_turns_that_begin_with_a_scored_token),
    # same launch
    jobs["tp2"] = ["--model", tiny_ckpts["qwen3"], "--batch", tp2_batch, "--objective", "opd",
                   "--tp", "2"]
    af = ["--model", tiny_qwen2, "--batch", action_first_batch[1], "--objective", "opd",
          "--save-grads", "all"]
    jobs.update(af_sync=[*af, "--schedule", "sync"],
                af_thundersync=[*af, "--schedule", "thundersync"])
    out = replay_many(jobs, str(d))
    out.update(rows=rows, hf_dir=tiny_qwen2, tp2_rows=tp2_rows)
    return out


def _grad(run, k=0):
    return load_file(os.path.join(run["dir"], f"grad_{k}.safetensors"))


def test_per_turn_streaming_matches_sync(opd_runs):
    for name, base in [("thundersync_fp32", "sync_fp32"), ("retain", "sync_fp32"),
                       ("thundersync", "sync")]:
        err = rel_l2(_grad(opd_runs[name]), _grad(opd_runs[base]))
        print(f"OPD {name} vs {base}: direction rel L2 = {err:.2e}")
        assert err <= 1e-6


def test_opd_matches_independent_fp64_reference(opd_runs):
    rows0 = [r for r in opd_runs["rows"] if r["policy_version"] == 0]
    ref = reference_opd_grad(opd_runs["hf_dir"], rows0)
    for name in ("sync_fp32", "thundersync_fp32", "retain"):
        got = _grad(opd_runs[name])
        assert got.keys() == ref.keys()
        err = rel_l2(got, ref)
        print(f"OPD {name} vs FP64 HF reference (Eq. 8-9): {err:.2e}")
        assert err <= 1e-5


def test_opd_parameter_gap_after_ten_updates(opd_runs):
    theta0 = load_file(os.path.join(opd_runs["hf_dir"], "model.safetensors"))
    params = {n: load_file(os.path.join(opd_runs[n]["dir"], "params.safetensors"))
              for n in ("sync", "thundersync", "sync_fp32", "thundersync_fp32")}
    for a, b, bound in [("thundersync", "sync", 1e-5), ("thundersync_fp32", "sync_fp32", 2e-4)]:
        pa, pb = params[a], params[b]
        moved = sum(float(((pb[k].double() - theta0[k].double()) ** 2).sum()) for k in pb) ** 0.5
        gap = sum(float(((pa[k].double() - pb[k].double()) ** 2).sum()) for k in pb) ** 0.5
        print(f"OPD {a} vs {b}: parameter gap / distance moved after {N_UPDATES} updates = "
              f"{gap / moved:.2e}")
        assert moved > 0 and gap / moved <= bound


def test_deferred_replay_is_in_the_trace_and_memory_is_bounded(opd_runs):
    run = opd_runs["thundersync"]
    entries = []
    for r in range(2):
        entries += trace.read(os.path.join(run["dir"], f"trace_rank{r}.jsonl"))
    turns = [e for e in trace.sources(entries) if e.source == "turn"]
    replays = [e for e in entries if isinstance(e, DeferredRecord) and e.work == "replay"]
    n_turns = sum(len(r["turn_ends"]) for r in opd_runs["rows"])
    assert len(turns) == n_turns
    assert len(replays) == len(opd_runs["rows"])  # one deferred replay per trajectory
    assert all(e.start <= e.end for e in trace.work(entries))
    assert all(e.policy_version == e.update for e in turns)
    # K/V leaves + adjoints never exceed 2× the K/V of all trajectories of a batch on a rank;
    # with streaming only open trajectories hold them. Per token per layer: 2 (K,V) × ng × hn.
    s = run["summary"]
    assert len(s["kv_peak_bytes_per_rank"]) == 2
    assert 0 < min(s["kv_peak_bytes_per_rank"])
    with open(os.path.join(opd_runs["hf_dir"], "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    spec_bytes_per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4
    per_update = max(sum(len(r["tokens"]) for r in opd_runs["rows"] if r["policy_version"] == v)
                     for v in range(N_UPDATES))
    assert max(s["kv_peak_bytes_per_rank"]) <= 2 * per_update * spec_bytes_per_token


def test_opd_bad_input_rejected(tiny_qwen2):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests/helpers/workers/opd_bad_input_worker.py"),
                        tiny_qwen2], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-5000:]
    res = parse_results(p.stdout)[0]
    errs = res["errors"]
    assert all(v != "NO ERROR" for v in errs.values()), errs
    assert "teacher log-prob missing" in errs["teacher_missing"]
    assert "is not a log-probability in" in errs["teacher_nan"]
    assert "differ in length" in errs["teacher_misaligned"]
    assert "policy version" in errs["wrong_version"]
    assert "duplicate" in errs["duplicate"]
    assert "contiguous" in errs["gap_in_spans"]
    assert "missing" in errs["missing_turns"]
    assert res["theta_untouched_by_errors"]
    assert res["out_of_order_turn_held_then_served"]
    assert res["grad_equal_to_clean"] <= 1e-6


def test_opd_tensor_parallel_two_ranks_vs_reference(tiny_ckpts, opd_runs):
    hf_dir, run = tiny_ckpts["qwen3"], opd_runs["tp2"]
    assert run["summary"]["tp"] == 2
    got = load_file(os.path.join(run["dir"], "grad.safetensors"))
    err = rel_l2(got, reference_opd_grad(hf_dir, opd_runs["tp2_rows"]))
    print(f"OPD qwen3 TP=2 vs FP64 HF reference: {err:.2e}")
    assert err <= 1e-5


def test_opd_learner_behind_the_rollout_finishes_started_trajectories_first(tiny_qwen2):
    # Handed several turns at once, the learner serves the next turn of the trajectory it
    # just served, then turns continuing started trajectories, and only then starts one.
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests/helpers/workers/opd_order_worker.py"),
                        tiny_qwen2], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-5000:]
    res = parse_results(p.stdout)[0]
    print(res)
    assert res["nothing_served_on_submit"] and res["first_two"] == [True, True]
    # A0 B0 | C0 A1 B1 arrive: B1 (B was served last), then A1 (started), then C0.
    assert res["order"] == ["o0#0", "o1#0", "o1#1", "o0#1", "o2#0"]
    assert res["idle_serve_next"] is False  # nothing servable: o0#2 has not arrived
    assert res["grad_vs_sync"] <= 1e-12
    # A whole batch at once: each trajectory's 3 turns back to back (16 of 23 successions),
    # fewer contexts open than in readiness order, the same gradient.
    assert res["backlog_same_next"] == 16 / 23
    assert res["readiness_same_next"] < 0.5
    assert res["backlog_kv_peak_bytes"] < res["readiness_kv_peak_bytes"]
    assert res["backlog_vs_readiness_grad"] <= 1e-12


def test_opd_cost_is_linear_in_turns_recompute_and_retain(tmp_path):
    # 20 turns × 16 tokens on a 4-layer model; FLOPs and memory for both replay modes.
    from tsync_mcore.model.tiny import make_tiny_checkpoint
    hf_dir = make_tiny_checkpoint(str(tmp_path / "q4"), arch="qwen2", layers=4)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests/helpers/workers/opd_cost_worker.py"),
                        hf_dir], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-5000:]
    res = parse_results(p.stdout)[0]
    for mode in ("recompute", "retain"):
        r = res[mode]
        print(f"OPD {mode}: total/plain FLOPs {r['total_over_plain']:.3f}, deferred/plain "
              f"{r['deferred_over_plain']:.3f}, saved activations peak {r['saved_peak_bytes']} B "
              f"(plain {res['plain_saved_peak_bytes']} B), K/V leaves+adjoints {r['kv_peak_bytes']} B")
        print(f"  ledger vs FlopCounterMode: {r['ledger_err']:.2e}")
        assert r["ledger_err"] <= 0.02
        assert r["total_over_plain"] <= 2.2
        assert r["deferred_over_plain"] <= 0.55
    # retain trades memory for the recomputation
    assert res["retain"]["deferred_flops"] < res["recompute"]["deferred_flops"]
    assert res["retain"]["saved_peak_bytes"] > 5 * res["recompute"]["saved_peak_bytes"]


@pytest.fixture(scope="module")
def one_rank_replays(tiny_qwen2, action_first_batch, tmp_path_factory):
    """The one-rank replays of the tests below in one process (each job its own Policy and
    Learner, see replay_many): shared prompt on/off, the action-first batch's retain run,
    and admission's unconstrained, k_open = 1 and group_ready runs. Returns the runs, the
    action-first batch (rows, file) and the admission runs' arguments."""
    d = tmp_path_factory.mktemp("one_rank")
    shared = str(d / "shared.jsonl")
    write_opd_batches(shared, 256, n_updates=1, seed=6, n_traj=4, group_size=4, prompt_len=10)
    off = d / "off.yaml"
    off.write_text("learner:\n  shared_prefix: false\n")
    sp = ["--model", tiny_qwen2, "--batch", shared, "--objective", "opd"]
    rows, af = action_first_batch
    # admission: 8 trajectories in 4 groups of 2
    adm = str(d / "admission.jsonl")
    write_opd_batches(adm, 256, n_updates=1, seed=3, n_traj=8, turns=3)
    common = ["--model", tiny_qwen2, "--batch", adm, "--objective", "opd", "--accum-dtype",
              "fp64"]
    runs = replay_many({
        "sp_on": sp, "sp_off": [*sp, "--config", str(off)],
        "af_retain": ["--model", tiny_qwen2, "--batch", af, "--objective", "opd",
                      "--save-grads", "all", "--opd-replay", "retain"],
        "adm_free": common, "adm_one": [*common, "--k-open", "1"],
        "adm_solo": [*common, "--k-open", "1", "--schedule", "group_ready"]}, str(d), nproc=1)
    return dict(runs=runs, action_first=(rows, af), admission=common)


def _grad_of(run) -> dict:
    return load_file(os.path.join(run["dir"], "grad.safetensors"))


def test_opd_shared_prompt_same_update(one_rank_replays):
    runs = one_rank_replays["runs"]
    err = rel_l2(_grad_of(runs["sp_on"]), _grad_of(runs["sp_off"]))
    print(f"OPD shared prompt on vs off: {err:.2e}")
    assert err <= 1e-6


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_turns_that_begin_with_a_scored_token(tiny_qwen2, opd_runs, one_rank_replays):
    # "action, then its observation": every turn but the first starts with a scored token,
    # whose log-prob comes from the previous turn's last position.
    rows, batch = one_rank_replays["action_first"]
    assert sum(r["scored_mask"][e] for r in rows for e in r["turn_ends"][:-1]) == 8
    # sync and thundersync on 2 ranks (in opd_runs' launch)
    runs = {"sync": opd_runs["af_sync"], "thundersync": opd_runs["af_thundersync"]}
    runs["retain"] = one_rank_replays["runs"]["af_retain"]  # one rank, --opd-replay retain
    grads = {n: _grad_of(r) for n, r in runs.items()}
    ref = reference_opd_grad(tiny_qwen2, rows)
    for name in ("thundersync", "retain"):
        err = rel_l2(grads[name], grads["sync"])
        print(f"OPD action-first {name} vs sync: {err:.2e}")
        assert err <= 1e-6
    for name in runs:
        err = rel_l2(grads[name], ref)
        print(f"OPD action-first {name} vs FP64 HF reference: {err:.2e}")
        assert err <= 1e-5


def test_opd_admission_k_open_and_byte_budget(one_rank_replays, tmp_path):
    # 8 trajectories in 4 groups of 2. k_open = 1: one group holds contexts at a time; a
    # byte budget of what one group needs does the same; the update does not change.
    common = one_rank_replays["admission"]
    first = {n: one_rank_replays["runs"][f"adm_{n}"] for n in ("free", "one", "solo")}
    free, one, solo = (first[n]["summary"] for n in ("free", "one", "solo"))
    assert free["open_groups_peak_per_rank"][0] > 1
    assert one["open_groups_peak_per_rank"] == [1] and one["open_bound"].startswith("k_open=1")
    assert one["open_peak_bytes_per_rank"][0] < free["open_peak_bytes_per_rank"][0]
    # a budget of one group's need (measured with k_open = 1, under group_ready, where a
    # group's estimate covers all of it)
    budget = solo["open_peak_bytes_per_rank"][0]
    cfg = tmp_path / "budget.yaml"
    cfg.write_text(f"learner:\n  max_open_bytes: {budget}\n")
    runs = replay_many({f"b_{s}": [*common, "--schedule", s, "--config", str(cfg)]
                        for s in ("group_ready", "thundersync")}, str(tmp_path), nproc=1)
    runs = {s: runs[f"b_{s}"]["summary"] for s in ("group_ready", "thundersync")}
    assert runs["group_ready"]["open_peak_bytes_per_rank"][0] <= budget
    assert f"max_open_bytes={budget}" in runs["group_ready"]["open_bound"]
    for s, r in runs.items():
        # a second group never opens next to one holding the budget
        assert r["open_groups_peak_per_rank"] == [1], (s, r)
    ref = _grad_of(first["free"])
    for name, run in [("one", first["one"]), ("solo", first["solo"]),
                      *((f"b_{s}", {"dir": str(tmp_path / f"b_{s}")})
                        for s in ("group_ready", "thundersync"))]:
        err = rel_l2(_grad_of(run), ref)
        print(f"OPD admission {name} vs unconstrained: {err:.2e}")
        # FP64 sums, but packed passes (the default) hold different turns under each
        # admission, and a pass's FP32 gradient depends on its company (docs/design/numerics.md)
        assert err <= 1e-6
