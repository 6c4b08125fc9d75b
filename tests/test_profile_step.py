"""bench/profile_step.py: HLO categories, trace parsing and a CPU smoke run."""

import gzip
import importlib.util
import json
import math
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_step", ROOT / "bench" / "profile_step.py")
ps = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ps)

HLO = """
HloModule jit_step

%fused_q (p: f32[64,128]) -> f8e4m3fn[64,128] {
  %p = f32[64,128]{1,0} parameter(0)
  ROOT %c = f8e4m3fn[64,128]{1,0} convert(%p)
}

ENTRY %main (a: f32[64,128], w: f8e4m3fn[128,256]) -> bf16[64,256] {
  %a = f32[64,128]{1,0} parameter(0)
  %w = f8e4m3fn[128,256]{1,0} parameter(1)
  %quant_fusion.1 = f8e4m3fn[64,128]{1,0} fusion(%a), kind=kLoop, calls=%fused_q
  %dequant_fusion = f32[128,256]{1,0} fusion(%w), kind=kLoop, calls=%fused_d
  %gemm.2 = (bf16[64,256]{1,0}, s8[4096]{0}) custom-call(%quant_fusion.1, %w), custom_call_target="__cublas$lt$matmul$f8"
  %gemm.3 = (bf16[64,256]{1,0}, s8[4096]{0}) custom-call(%a, %a), custom_call_target="__cublas$lt$matmul"
  %all-gather-start.4 = (f8e4m3fn[64,128]{1,0}, f8e4m3fn[128,128]{1,0}) all-gather-start(%quant_fusion.1), dimensions={0}
  %all-reduce.5 = (f32[], f32[]) all-reduce(%x, %y), to_apply=%add
  %fusion.6 = f32[64]{0} fusion(%a), kind=kInput, calls=%reduce_it
  %triton_gemm.7 = bf16[64,256]{1,0} fusion(%a, %a), kind=kCustom, calls=%g, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %triton_red.11 = f32[64]{0} fusion(%a), kind=kCustom, calls=%r, backend_config={"fusion_backend_config":{"kind":"__triton"}}
  %fmha.8 = (bf16[2,8,64,64]{3,2,1,0}, u8[0]{0}) custom-call(%a), custom_call_target="__cudnn$fmhaSoftmax"
  %mosaic.9 = f32[8]{0} custom-call(%a), custom_call_target="mosaic_gpu_v2"
  ROOT %copy.10 = f32[128,64]{0,1} copy(%a)
}
"""  # noqa: E501 (HLO lines as XLA prints them)


def test_hlo_categories():
    cats = ps.hlo_categories(HLO)
    assert cats["quant_fusion.1"] == "FP8 quantize (fusion)"
    assert cats["dequant_fusion"] == "fusion reading FP8"
    assert cats["gemm.2"] == "GEMM, FP8 (cuBLASLt)"
    assert cats["gemm.3"] == "GEMM (cuBLAS)"
    assert cats["all-gather-start.4"] == cats["all-reduce.5"] == "communication"
    assert cats["fusion.6"] == "elementwise / reduction (fusion)"
    assert cats["triton_gemm.7"] == "GEMM (Triton)"
    assert cats["triton_red.11"] == "elementwise / reduction (fusion)"  # XLA's Triton reduction
    assert cats["fmha.8"] == "attention (cuDNN)"
    assert cats["mosaic.9"] == "Pallas / Triton kernel"
    assert cats["copy.10"] == "copy / transpose"
    assert cats["c"] == "other"  # inside a fused computation: never a device op of its own


def test_hlo_signatures():
    sigs = ps.hlo_signatures(HLO)
    assert sigs["quant_fusion.1"] == "FP8 quantize (fusion) | fusion kLoop | f8e4m3fn[64,128]"
    assert sigs["gemm.2"] == (
        "GEMM, FP8 (cuBLASLt) | custom-call __cublas$lt$matmul$f8 | (bf16[64,256], s8[4096])")
    assert sigs["triton_gemm.7"] == "GEMM (Triton) | fusion __triton_gemm | bf16[64,256]"
    assert sigs["copy.10"] == "copy / transpose | copy | f32[128,64]"
    # summed by signature: two layers' copies of one op are one row
    ops = [("quant_fusion.1", 100.0, 7), ("gemm.2", 300.0, 7), ("gemm.2", 300.0, 7),
           ("unknown.3", 50.0, 7)]  # fmt: skip
    rows = ps.summarize(ops, ps.hlo_categories(HLO), steps=1, top=3, signatures=sigs)
    rows = rows["top_signatures"]
    assert [r["signature"] for r in rows] == [sigs["gemm.2"], sigs["quant_fusion.1"],
                                              "other | unknown.3"]  # fmt: skip
    assert rows[0]["ops_per_step"] == 2 and rows[0]["ms_per_step"] == pytest.approx(0.6)


def _trace(tmp_path):
    def meta(kind, pid, name, tid=None):
        return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": {"name": name}}

    def op(pid, tid, name, dur, args=None):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur, "args": args or {}}

    events = [
        meta("process_name", 1, "/host:CPU"), meta("process_name", 7, "/device:GPU:0"),
        meta("process_name", 8, "/device:GPU:1"),
        meta("thread_name", 7, "XLA Ops", 1), meta("thread_name", 7, "Stream #13", 2),
        meta("thread_name", 8, "Stream #13", 2),
        op(1, 0, "host work", 5000.0),
        op(7, 1, "gemm.2", 600.0), op(7, 1, "quant_fusion.1", 200.0),
        op(7, 2, "sm90_xmma_gemm_e4m3", 590.0),  # the same GEMM's kernel: not counted again
        op(8, 2, "kernel", 600.0, {"hlo_op": "%gemm.2"}),
        op(8, 2, "ncclDevKernel_AllGather", 200.0),
    ]  # fmt: skip
    path = tmp_path / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    import gzip

    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return tmp_path


def test_device_ops_and_summary(tmp_path):
    ops, layout = ps.device_ops(ps._load_trace(str(_trace(tmp_path))))
    assert sorted((n, d) for n, d, *_ in ops) == [
        ("gemm.2", 600.0), ("gemm.2", 600.0), ("ncclDevKernel_AllGather", 200.0),
        ("quant_fusion.1", 200.0)]  # fmt: skip
    assert layout["/device:GPU:0"] == {"XLA Ops": 2, "Stream #13": 1}
    summary = ps.summarize(ops, ps.hlo_categories(HLO), steps=2, top=2)
    # 1600 us over 2 steps and 2 devices: 0.4 ms per step per device
    assert summary["trace_devices"] == 2 and summary["device_ms_per_step"] == pytest.approx(0.4)
    cats = summary["categories"]
    assert cats["GEMM, FP8 (cuBLASLt)"]["ms_per_step"] == pytest.approx(0.3)
    assert cats["communication"]["share"] == pytest.approx(0.125)  # by kernel name
    assert cats["FP8 quantize (fusion)"]["share"] == pytest.approx(0.125)
    assert [o["name"] for o in summary["top_ops"]] == ["gemm.2", "quant_fusion.1"]
    assert summary["communication_ms_per_step"] == {"other": pytest.approx(0.05)}  # no HLO name
    pid = ops[0][2]  # the last two names are not in the HLO: kind from the name alone
    ops += [("all-gather-start.4", 400.0, pid), ("all-gather.7", 400.0, pid)]
    ops += [("reduce-scatter.9", 400.0, pid)]
    kinds = ps.collective_kinds(HLO)
    assert kinds == {"all-gather-start.4": "all-gather f8e4m3fn", "all-reduce.5": "all-reduce f32"}
    summary = ps.summarize(ops, ps.hlo_categories(HLO), steps=2, top=2, kinds=kinds)
    assert summary["communication_ms_per_step"] == {
        "all-gather f8e4m3fn": pytest.approx(0.1), "all-gather": pytest.approx(0.1),
        "reduce-scatter": pytest.approx(0.1),
        "other": pytest.approx(0.05)}  # fmt: skip


def test_timeline_splits_steps_at_the_widest_gaps_and_counts_idle_time():
    # (name, us, pid, start): device 7 runs two steps (the second after the host's wait), one
    # op inside another's interval; device 8 one op a step
    ops = [("a", 100.0, 7, 0.0), ("b", 90.0, 7, 110.0), ("c", 30.0, 7, 150.0),
           ("d", 100.0, 7, 1000.0), ("e", 50.0, 7, 1150.0),
           ("f", 50.0, 8, 2000.0), ("g", 50.0, 8, 0.0)]  # fmt: skip
    t = ps.timeline(ops, steps=2)
    # device 7: step 1 spans 200 us, busy 190, 3 kernels; step 2 spans 200, busy 150, 2
    # kernels; device 8: 50 / 50 / 1. Medians over steps, then the mean over devices
    assert t["kernels_per_step"] == pytest.approx((2.5 + 1) / 2)
    assert t["span_ms"] == pytest.approx((200 + 50) / 2 / 1e3)
    assert t["busy_ms"] == pytest.approx((170 + 50) / 2 / 1e3)
    assert t["idle_in_step_ms"] == pytest.approx((30 + 0) / 2 / 1e3)
    # one step: nothing split off; no ops: nothing to say
    one = ps.timeline([op for op in ops if op[2] == 7][:3], steps=1)
    assert one["kernels_per_step"] == 3 and one["idle_in_step_ms"] == pytest.approx(0.01)
    assert ps.timeline([], steps=3) == {}


def test_cpu_smoke(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() adds a flag
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")  # the user's setting wins
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.setattr(os, "environ", os.environ.copy())  # main() sets the allocator's defaults
    out = tmp_path / "p.json"
    result = ps.main(["--config", str(ROOT / "configs" / "llama_tiny.py"), "--set",
                      "precision=coat", "--set", "seq_len=32", "--set", "batch_size=2",
                      "--steps", "2", "--warmup", "1", "--trace_dir", str(tmp_path / "trace"),
                      "--json", str(out), "--hlo", str(tmp_path / "step.hlo.gz")])  # fmt: skip
    saved = json.loads(out.read_text())
    with gzip.open(tmp_path / "step.hlo.gz", "rt") as f:  # the module the trace's names are of
        assert len(ps.hlo_categories(f.read())) == saved["hlo_instructions"]
    assert saved["step_ms_median"] > 0 and saved["compile_s"] > 0 and saved["tokens_per_s"] > 0
    assert saved["hlo_instructions"] > 100 and result["mesh"] == saved["mesh"]
    assert saved["gemm_backend"] == "xla"  # config.fp8.gemm
    assert saved["allocator"] == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                                  "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}  # fmt: skip
    assert isinstance(saved["top_signatures"], list) and saved["timeline"] == {}  # no device ops
    assert "--xla_gpu_enable_command_buffer=" in saved["xla_flags"]  # kernels keep their names
    assert saved["peak_bytes_per_device"] == [None] * math.prod(saved["mesh"].values())  # a CPU
    with pytest.raises(SystemExit):  # a missing folder stops the parser, before any compile
        ps.parse_args(["--hlo", str(tmp_path / "no_such_dir" / "step.hlo")])
    with pytest.raises(ValueError, match="precision"):
        ps.main(["--config", str(ROOT / "configs" / "llama_tiny.py"), "--set", "precision=fp4"])
