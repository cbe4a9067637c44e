"""The kernel profile summary (runners/kernel_probe.py) on made-up profiler events, its kernel
categories on kernel names as cuBLAS, cuDNN, TE, torch and NCCL name them, and the job keys that
ask for it (kernel_profile_steps) and for torch's expandable segments, from a batch line to the
record (through the fake worker)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from advisor.catalog.specs import ModelSpec, SpecError
from advisor.runners import kernel_probe as K
from advisor.runners import measure as M

DATA = Path(__file__).parent / "data" / "measure"
TINY = ModelSpec(name="tiny", num_layers=4, hidden_size=256, ffn_hidden_size=512,
                 num_attention_heads=8, num_query_groups=2, vocab_size=1000)

NAMES = [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm bf16/other"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
     "gemm fp8"),
    ("sm90_xmma_gemm_e5m2e4m3_e5m2f32_f32_nn_n_tilesize64x128x128_cublas", "gemm fp8"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "gemm bf16/other"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_32x6_tn_align8>(Params)",
     "gemm bf16/other"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl AllReduce"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "nccl ReduceScatter"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl SendRecv"),
    ("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclWorkElem)", "nccl AllGather"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"),
    ("Memset (Device)", "memcpy/memset"),
    ("cudnn_generated_fortran_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x128x128_4x1x1_kernel0_0",
     "attention fwd"),
    ("cudnn_generated_fortran_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
     "attention bwd"),
    ("void flash::flash_bwd_dot_do_o_kernel<true, Flash_bwd_kernel_traits<128, 64>>(Flash_bwd_params)", "attention bwd"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64>, false>(Flash_fwd_params)",
     "attention fwd"),
    ("void transformer_engine::delayed_scaling_recipe::(anonymous namespace)::kernel_bulk(float*, float const*)",
     "fp8 amax/scale"),
    ("void transformer_engine::detail::cast_transpose_general_kernel<false, float, __nv_bfloat16, __nv_fp8_e4m3>(Param)",
     "fp8 cast/transpose"),
    ("void transformer_engine::multi_cast_transpose_kernel<8, true, float, __nv_bfloat16, __nv_fp8_e4m3>(MultiParam)",
     "fp8 cast/transpose"),
    ("void transformer_engine::(anonymous namespace)::cast_fp8_1D_kernel<false, float, __nv_bfloat16>(float const*)",
     "fp8 cast/transpose"),
    ("void transformer_engine::normalization::rmsnorm_fwd_tuned_kernel<transformer_engine::normalization::"
     "Kernel_traits<float, __nv_bfloat16, __nv_fp8_e4m3, float, unsigned int, 4096u>>(FwdParams)", "norm"),
    ("void transformer_engine::(anonymous namespace)::cast_fp8_gated_kernel<true, float, &silu<float, float>>(T*)",
     "activation"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float, float, long>, float>(long)", "optimizer"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<1>, L2NormFunctor<float, 512, 8>, float*>(long)", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, "
     "std::array<char*, 3ul>>(int, T, F)", "elementwise/reduce"),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<Policy900, false, long, int>(int*)", "index/permute/sort"),
    ("void transformer_engine::(anonymous namespace)::fused_rope_forward_kernel<__nv_bfloat16>(T const*)", "rope"),
    ("some_new_kernel_nobody_knows", "other"),
]


@pytest.mark.parametrize("name,cat", NAMES)
def test_categories_of_real_kernel_names(name, cat):
    assert K.categorize(name) == cat


def test_the_table_has_one_comment_per_pattern_and_unique_keys():
    keys = [k for k, _, _ in K.CATEGORIES]
    assert len(keys) == len(set(keys)) and all(c.strip() for _, _, c in K.CATEGORIES)
    assert {cat.split(" ")[0] if cat.startswith("nccl") else cat for _, cat in NAMES} - {"other"} <= set(keys)


def test_union_of_intervals():
    assert K.union_us([]) == 0.0
    assert K.union_us([(0, 10), (5, 15), (20, 30), (30, 31), (2, 3)]) == 26.0


def _ev(name, s, e, stream=7):
    return K.Ev(name, True, float(s), float(e), stream, None)


def _cpu(name, s, e, thread=1):
    return K.Ev(name, False, float(s), float(e), None, thread)


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_cublas"
FP8 = "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_cublas"
CAST = "void transformer_engine::detail::cast_transpose_general_kernel<float>(Param)"
AR = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"


def _two_steps():
    """Two 10 ms steps: per step a 4 ms GEMM and a 1 ms cast on stream 7 (a 1 ms gap between
    them), a 3 ms FP8 GEMM on stream 13 overlapping the GEMM by 2 ms, and a 2 ms all-reduce on
    stream 20; the host thread 1 is busy 6 ms (2 ms of it a sync), thread 2 (autograd) 3 ms."""
    evs = []
    for k in range(2):
        t = 10_000 * k
        evs += [_ev(GEMM, t, t + 4000), _ev(CAST, t + 5000, t + 6000), _ev(FP8, t + 2000, t + 5000, 13),
                _ev(AR, t + 6000, t + 8000, 20),
                _cpu("aten::mm", t, t + 4000), _cpu("cudaLaunchKernel", t + 10, t + 20),
                _cpu("cudaLaunchKernel", t + 30, t + 40), _cpu("cudaStreamSynchronize", t + 4000, t + 6000),
                _cpu("autograd::engine::evaluate_function: MmBackward0", t + 1000, t + 4000, 2),
                _cpu("cudaLaunchKernel", t + 1100, t + 1110, 2)]
    return evs


def test_summary_of_two_made_up_steps():
    s = K.summarize(_two_steps(), 2, [0.010, 0.010], measured_step_s=0.008)
    cat = s["categories"]
    assert cat["gemm bf16/other"] == {"ms": 4.0, "count": 1.0}
    assert cat["gemm fp8"] == {"ms": 3.0, "count": 1.0}
    assert cat["fp8 cast/transpose"] == {"ms": 1.0, "count": 1.0}
    assert cat["nccl AllReduce"] == {"ms": 2.0, "count": 1.0}
    assert list(cat)[0] == "gemm bf16/other"  # largest first
    assert s["gpu_ms_total"] == 10.0 and s["kernels"] == 4.0
    assert [t["name"] for t in s["top"]] == [GEMM, FP8, AR, CAST[:K.NAME_CHARS]]
    assert s["top"][0] == {"name": GEMM, "ms": 4.0, "count": 1.0, "category": "gemm bf16/other"}
    g = s["gpu"]
    assert g["compute_stream"] == 7 and g["streams"] == 3
    assert g["compute_stream_busy"] == pytest.approx(0.5)  # 4 + 1 ms of 10
    assert g["non_nccl_busy"] == pytest.approx(0.6)  # [0, 6] ms
    assert g["any_busy"] == pytest.approx(0.8)  # [0, 8] ms
    h = s["host"]
    assert [x["thread"] for x in h] == [1, 2]
    assert h[0] == {"thread": 1, "busy_ms": 6.0, "sync_ms": 2.0, "issue_ms": 4.0, "launches": 2.0, "events": 4.0}
    assert h[1]["busy_ms"] == 3.0 and h[1]["launches"] == 1.0
    assert s["overhead"] == {"profiled_step_s": 0.01, "measured_step_s": 0.008, "ratio": 1.25}
    assert s["other_top"] == []
    json.dumps(s)  # goes into an event line as it is


def test_summary_top_is_cut_and_other_kernels_are_listed():
    evs = [_ev(f"kernel_{i}", 100 * i, 100 * i + i + 1) for i in range(40)]
    s = K.summarize(evs, 1, [0.01])
    assert len(s["top"]) == 25 and s["top"][0]["name"] == "kernel_39"
    assert len(s["other_top"]) == 8 and s["categories"]["other"]["count"] == 40
    assert s["overhead"]["ratio"] is None


def test_summary_refuses_mismatched_steps():
    with pytest.raises(ValueError):
        K.summarize([], 2, [0.1])


def test_thread_cpu_delta_and_snapshot():
    before = {10: ("python3", 1.0), 11: ("pt_autograd_0", 0.5)}
    after = {10: ("python3", 1.5), 11: ("pt_autograd_0", 0.9), 12: ("nccl", 0.1)}
    d = K.thread_cpu_delta(before, after, 2, main_tid=10)
    assert d["main_thread_ms"] == pytest.approx(250.0) and d["all_threads_ms"] == pytest.approx(500.0)
    assert [b["name"] for b in d["busiest"]] == ["python3", "pt_autograd_0", "nccl"]
    assert d["busiest"][0]["main"] and not d["busiest"][1]["main"]
    assert K.thread_cpu_delta(None, after, 2, 10) is None
    snap = K.thread_cpu_snapshot()
    if sys.platform.startswith("linux"):
        import threading
        assert threading.main_thread().native_id in snap
        assert all(isinstance(n, str) and t >= 0 for n, t in snap.values())


# ----------------------------------------------------------------- job keys, batch to record
def test_batch_line_keys_reach_the_job():
    e = M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "gbs": 8,
                           "kernel_profile_steps": 2, "expandable_segments": True}, 4)
    assert e.kernel_profile_steps == 2 and e.config.expandable_segments and not e.refused
    job = M.job_for(e, 0)
    assert job["kernel_profile_steps"] == 2 and job["expandable_segments"] is True
    assert M.entry_from_dict(M.entry_to_dict(e)).kernel_profile_steps == 2
    plain = M.job_for(M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1}, 4), 0)
    assert "kernel_profile_steps" not in plain and "expandable_segments" not in plain
    off = M.entry_from_line({"model": "llama3-8b", "layers": 2, "dp": 4, "mbs": 1, "expandable_segments": False}, 4)
    assert not off.config.expandable_segments


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_bad_kernel_profile_steps_is_a_spec_error(bad):
    with pytest.raises(SpecError, match="kernel_profile_steps"):
        M.make_entry(TINY, 2, mbs=1, gbs=2, kernel_profile_steps=bad)


def test_record_keeps_the_kernel_profile_and_the_allocator(tmp_path, monkeypatch):
    def cmd(nproc, run_dir, start=0, python=None):
        return [sys.executable, str(DATA / "fake_worker.py"), str(run_dir), str(start), str(nproc)]
    monkeypatch.setattr(M, "torchrun_command", cmd)
    monkeypatch.setattr(M, "WORKER", DATA / "fake_worker.py")
    es = [M.make_entry(TINY, 2, mbs=1, gbs=4, warmup=1, steps=2, kernel_profile_steps=2, expandable_segments=True),
          M.make_entry(TINY, 2, mbs=1, gbs=4, warmup=1, steps=2)]
    es[0].id, es[1].id = "ok-kp", "ok-plain"
    ds = tmp_path / "out.jsonl"
    M.run_batch(es, ds, 2, run_dir=tmp_path / "run", timeout=20.0, telemetry="off")
    by_id = {r["id"]: r for r in M.read_jsonl(ds)}
    kp = by_id["ok-kp"]
    assert kp["status"] == "ok" and kp["kernel_profile"]["categories"]["gemm bf16/other"]["ms"] == 0.6
    assert kp["kernel_profile"]["steps"] == 2
    assert kp["env"]["alloc_conf"] == "expandable_segments:True" and kp["config"]["expandable_segments"]
    plain = by_id["ok-plain"]
    assert "kernel_profile" not in plain and plain["env"]["alloc_conf"] == "expandable_segments:False"
    assert not plain["config"]["expandable_segments"]


# ------------------------------------------------------------------ the reader and the batch
def _record(i, prec, mbs=2, kp=None):
    return {"id": f"te-x-{i}", "status": "ok", "model_name": "llama3-8b", "layers": 8,
            "config": {"seq": 4096, "gbs": 32, "tp": 1, "pp": 1, "vp": 1, "cp": 1, "ep": 1, "etp": 1, "dp": 4,
                       "mbs": mbs, "recompute": "none", "sequence_parallel": False, "precision": prec},
            "steps": {"median_s": 0.01},
            "kernel_profile": kp or K.summarize(_two_steps(), 2, [0.010, 0.010], 0.009)}


def test_reader_puts_each_bf16_fp8_pair_side_by_side(tmp_path, capsys):
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import kernel_profile as reader

    fp8 = _record(1, "fp8")
    fp8["kernel_profile"]["categories"]["fp8 cast/transpose"] = {"ms": 2.5, "count": 3.0}
    p = tmp_path / "d.jsonl"
    recs = [_record(0, "bf16"), fp8, _record(2, "bf16", mbs=4, kp={"error": "RuntimeError: boom"}),
            {"id": "no-profile", "status": "ok"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert reader.main([str(p), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("== llama3-8b[8L]") == 2 and "bf16 (te-x-0)" in out and "fp8 (te-x-1)" in out
    cast = next(ln for ln in out.splitlines() if ln.strip().startswith("fp8 cast/transpose"))
    assert "1.00 ms x1" in cast and "2.50 ms x3" in cast and cast.rstrip().endswith("+1.50")
    assert "te-x-2: kernel profile failed: RuntimeError: boom" in out
    assert reader.main([str(tmp_path / "missing.jsonl")]) == 2
    q = tmp_path / "none.jsonl"
    q.write_text(json.dumps({"id": "a"}) + "\n")
    assert reader.main([str(q)]) == 2
    assert capsys.readouterr().err.startswith("error:")


def test_s24_batches_profile_the_pairs_first_with_new_ids():
    sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
    import te_campaign as T

    root = Path(__file__).parent.parent
    measured = {r["id"]: r for p in (root / "data/measurements").glob("h100x4-te*.jsonl")
                for r in map(json.loads, filter(str.strip, p.read_text().splitlines()))}
    a, b = T.BATCHES["x4-te-s24a"](), T.BATCHES["x4-te-s24b"]()
    assert len(a) == 8 and all(j["kernel_profile_steps"] == 2 for j in a)
    assert not any(j.get("kernel_profile_steps") for j in b)
    # the ids were new when the batches ran (te_device.sh skips measured ids); each id measured
    # since is the job its batch line describes, not an earlier job of the same name
    ids = [j["id"] for j in T.all_jobs()]
    assert len(ids) == len(set(ids))
    for j in a + b:
        r = measured.get(j["id"])
        if r is not None:
            assert (r["config"]["mbs"], r["config"]["precision"]) == (j["mbs"], j.get("precision", "bf16")), j["id"]
            assert ("kernel_profile" in r) == bool(j.get("kernel_profile_steps")), j["id"]
    prec = [(j["model"], j.get("cp", 1), j["mbs"], j.get("precision", "bf16")) for j in a]
    assert prec[:2] == [("llama3-8b", 1, 2, "bf16"), ("llama3-8b", 1, 2, "fp8")]
    assert [j.get("expandable_segments") for j in b[-2:]] == [False, True]  # the allocator pair last
    for j in a + b:
        assert not M.entry_from_line(j, 4).refused, j["id"]
    for name in ("x4-te-s24a", "x4-te-s24b"):  # the written batch files are these
        assert [json.loads(x) for x in (T.CONFIGS / f"{name}.jsonl").read_text().splitlines()] == T.BATCHES[name]()


def test_mixtral_ep4_fp8_is_host_paced():
    """Mixtral proxy EP4 mbs1 (te-mix-kp-10 / -11): FP8 cuts the profiled rank's GPU work by ~110 ms
    but the step by 18 ms: in BF16 its GPU work (370 ms) paces it, in FP8 its main thread's CPU time
    (350 ms, unchanged) does, and what the step holds beyond the longer of the two (exposed
    all-to-alls, waits for the other ranks: 142 / 145 ms) is the same in both precisions."""
    from tests.support import ROOT, load_bench

    kp = load_bench("kernel_profile")
    recs = {json.loads(x)["id"]: json.loads(x) for x in (ROOT / "data/measurements/h100x4-te.jsonl").read_text().splitlines()
            if x.strip() and '"te-mix-kp-1' in x}
    bf, f8 = recs["te-mix-kp-10"], recs["te-mix-kp-11"]
    host = lambda r: r["kernel_profile"]["host_cpu"]["measured"]["main_thread_ms"]  # noqa: E731
    gpu = lambda r: kp.gpu_work_ms(r, r["kernel_profile"])  # noqa: E731
    assert gpu(bf) > host(bf) and gpu(f8) < host(f8)
    assert gpu(bf) - gpu(f8) > 90 and abs(host(bf) - host(f8)) < 10
    rest = [kp.beyond_host_and_gpu_ms(r, r["kernel_profile"]) for r in (bf, f8)]
    assert abs(rest[0] - rest[1]) < 10, rest


def test_host_speed_reads_the_cpu_model_and_times_the_hosts_issue(tmp_path):
    """The worker's hello carries its host's CPU model and issue time per eager op
    (kernel_probe.host_speed): host-bound runs go at their host's pace, and lent machines differ."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                    "processor\t: 1\nmodel name\t: AMD EPYC 9654 96-Core Processor\n")
    assert K.cpu_model(str(info)) == "AMD EPYC 9654 96-Core Processor"
    assert K.cpu_model(str(tmp_path / "none")) is None
    info.write_text("processor\t: 0\n")
    assert K.cpu_model(str(info)) is None
    # a fake clock: each op costs 12 us of host time, each sync 1 ms; 3 rounds of 100 ops
    now = [0.0]
    calls = []

    def op():
        now[0] += 12e-6
        calls.append(1)

    def sync():
        now[0] += 1e-3

    us = K.host_op_us(op, sync, n=100, rounds=3, clock=lambda: now[0])
    assert len(calls) == 300 and us == pytest.approx(12.0 + 1e3 / 100)


def test_records_keep_the_hosts_speed_from_rank_0s_hello():
    e = M.make_entry(TINY, 2, mbs=1, gbs=2)
    ranks = {r: {"hello": {"uuid": f"GPU-{r}", "gpu_name": "NVIDIA H100 80GB HBM3",
                           "cpu_model": "Intel Xeon Platinum 8480+", "host_op_us": 9.5 + r}} for r in range(2)}
    rec = M.assemble_record(e, "crash", "boom", ranks, None)
    assert rec["env"]["cpu_model"] == "Intel Xeon Platinum 8480+" and rec["env"]["host_op_us"] == 9.5
    bare = M.assemble_record(e, "crash", "boom", {0: {"hello": {"gpu_name": "NVIDIA H100 80GB HBM3"}}}, None)
    assert "cpu_model" not in bare["env"] and "host_op_us" not in bare["env"]
