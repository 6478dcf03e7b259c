"""Hardware as data: the shipped catalogue files, spec files from disk (round trip, clear
errors), and the roofline's step time worked out by hand from a spec file's round numbers."""

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.config import ModelConfig
from pdserve.sim.analytic import AnalyticModel
from pdserve.sim.hardware import (
    DATA_DIR,
    ClusterSpec,
    Efficiency,
    catalogue_file,
    get_device,
    get_link,
    list_devices,
    load_hardware,
    save_hardware,
)

# (name, dense BF16 TFLOP/s, GB/s, GiB, intra-node link) from the vendors' sheets (cited in
# the files themselves)
SHEETS = [
    ("A100-80GB", 312.0, 2039.0, 80.0, "nvlink3"),
    ("A100-40GB", 312.0, 1555.0, 40.0, "nvlink3"),
    ("H100", 989.0, 3350.0, 80.0, "nvlink4"),
    ("H100-PCIe", 756.0, 2000.0, 80.0, "pcie5"),
    ("H200", 989.0, 4800.0, 141.0, "nvlink4"),
    ("B200", 2250.0, 7700.0, 180.0, "nvlink5"),
    ("L40S", 362.05, 864.0, 48.0, "pcie4"),
    ("L20", 119.5, 864.0, 48.0, "pcie4"),
    ("A10G", 70.0, 600.0, 24.0, "pcie4"),
    ("RTX-4090", 165.2, 1008.0, 24.0, "pcie4"),
    ("RTX-PRO-6000", 500.0, 1792.0, 96.0, "pcie5"),
    ("MI300X", 1307.4, 5300.0, 192.0, "xgmi-mi300x"),
]


@pytest.mark.parametrize("name,tflops,bw,gib,link", SHEETS)
def test_catalogue_matches_spec_sheets(name, tflops, bw, gib, link):
    d = get_device(name)
    assert (d.peak_tflops, d.memory_bw_gbs, d.memory_gib, d.intra_node_link) == \
        (tflops, bw, gib, link)
    assert d.sources, f"{name} cites no source"
    assert get_device(name.lower().replace("-", "_")) is d
    assert catalogue_file(name).parent == DATA_DIR
    get_link(d.intra_node_link)  # every intra-node link exists


def test_catalogue_names_aliases_and_cluster():
    assert {"A100-80GB", "A800-80GB", "cpu", "B200", "MI300X"} <= set(list_devices())
    assert get_device("a100") is get_device("A100-80GB")
    assert get_device("h100-sxm") is get_device("H100")
    assert get_device("4090") is get_device("RTX-4090")
    c = load_hardware("h100")
    assert (c.num_nodes, c.gpus_per_node, c.num_gpus, c.network) == (1, 8, 8, "ib-ndr")
    assert c.intra_node_link.bandwidth_gb_per_s == 450.0
    assert c.network_link.bandwidth_gb_per_s == 50.0
    assert get_link("nvlink5").bandwidth_gb_per_s == 900.0  # 1.8 TB/s bidirectional
    assert get_device("h100").flops_per_s("float8") == 1979e12
    with pytest.raises(ValueError, match="A100-80GB.*no FP8"):
        get_device("a100").flops_per_s("float8")


def test_spec_file_round_trip(tmp_path):
    dev = get_device("l40s")
    cluster = ClusterSpec(dev, num_nodes=4, gpus_per_node=2, network="eth-100g")
    for ext in ("yaml", "json"):
        p = tmp_path / f"l40s.{ext}"
        save_hardware(p, dev, cluster, header="test")
        back = load_hardware(str(p))
        assert back == cluster
        assert get_device(str(p)) == dev


def _write(tmp_path, text, name="gpu.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


GOOD = """format: pdserve-hardware
name: toy
peak_tflops: 100.0
memory_gib: 10
memory_bw_gbs: 1000.0
intra_node_link: toylink
links: [{name: toylink, bandwidth_gb_per_s: 100.0, latency_s: 0.0}]
efficiency: {mfu_gemm: 1.0, mfu_attention: 1.0, mbu_weights: 1.0, mbu_kv: 1.0, comm: 1.0,
             step_overhead_s: 0.0}
cluster: {num_nodes: 2, gpus_per_node: 4, network: toylink}
"""


def test_custom_device_file_with_its_own_link(tmp_path):
    c = load_hardware(_write(tmp_path, GOOD))
    assert c.device.name == "toy" and c.num_gpus == 8
    assert c.intra_node_link.bandwidth_gb_per_s == 100.0 and c.network_link.name == "toylink"
    assert c.device.efficiency == Efficiency(1.0, 1.0, 1.0, 1.0, 1.0, step_overhead_s=0.0)


@pytest.mark.parametrize("text,match", [
    (GOOD.replace("memory_bw_gbs: 1000.0\n", ""),
     r"missing required field\(s\) \['memory_bw_gbs'\]"),
    (GOOD.replace("peak_tflops: 100.0", "peak_tflops: fast"), "'peak_tflops' must be a number"),
    (GOOD.replace("peak_tflops: 100.0", "peak_tflops: 100.0\nwarp_speed: 9"),
     r"unknown field\(s\) \['warp_speed'\]"),
    (GOOD.replace("mfu_gemm: 1.0", "mfu_gemm: 1.5"), r"efficiency: mfu_gemm must be in \(0, 1\]"),
    (GOOD.replace("mfu_gemm: 1.0", "mfu_gmem: 1.0"),
     r"unknown field\(s\) \['mfu_gmem'\] in efficiency"),
    (GOOD.replace("gpus_per_node: 4", "gpus_per_node: 0"), "gpus_per_node must be >= 1"),
    (GOOD.replace("format: pdserve-hardware", "format: other"), "not a pdserve-hardware file"),
    ("name: [unclosed\n", "is not valid YAML"),
    ("- just a list\n", "expected a mapping"),
])
def test_malformed_files_name_file_and_field(tmp_path, text, match):
    p = _write(tmp_path, text)
    with pytest.raises(ValueError, match=match) as e:
        load_hardware(p)
    assert p in str(e.value)


def test_unknown_names_and_missing_files(tmp_path):
    with pytest.raises(ValueError,
                       match=r"unknown device 'v100'; choices: .*MI300X.*hardware file"):
        load_hardware("v100")
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ValueError, match=f"hardware file '{missing}' does not exist"):
        load_hardware(missing)
    p = _write(tmp_path, GOOD.replace("intra_node_link: toylink", "intra_node_link: warp"))
    with pytest.raises(ValueError, match="unknown link 'warp'"):
        AnalyticModel(_toy_model(), p)


def _toy_model(**kw) -> ModelConfig:
    d = dict(family="llama", vocab_size=1000, hidden_size=1024, intermediate_size=2048,
             num_layers=2, num_heads=8, num_kv_heads=8, max_position_embeddings=4096,
             tie_word_embeddings=True)
    d.update(kw)
    return ModelConfig(**d)


def test_roofline_by_hand_from_spec_file(tmp_path):
    """100 TFLOP/s, 1000 GB/s, every factor 1, no overheads; a 2-layer llama (hidden 1024, 8
    heads of 128, MLP 2048, vocab 1000), one decode at context 100, fp16.

    weights per layer: QKV 1024·3072 + O 1024·1024 + gate/up 1024·4096 + down 2048·1024
    = 10,485,760; ×2 layers + head 1,024,000 = 21,995,520 elements. Activations per layer and
    token: (1024+3072) + (1024+1024) + (1024+4096) + (2048+1024) = 14,336, ×2 = 28,672; plus the
    head's 1024 input. Bytes = 2·(21,995,520 + 28,672 + 1024) = 44,050,432 → 44.050432 µs at
    1 TB/s (FLOPs 2·21,995,520 = 0.44 µs: memory-bound). Decode attention reads K and V:
    2 B · 2 layers · 2 · 100 tokens · 1024 = 819,200 B → 0.8192 µs. Total 44.869632 µs."""
    m = AnalyticModel(_toy_model(), _write(tmp_path, GOOD))
    parts = m.breakdown([], [100])
    assert parts["linear"] == pytest.approx(44.050432e-6, rel=1e-12)
    assert parts["attn_decode"] == pytest.approx(0.8192e-6, rel=1e-12)
    assert m.step_time([], [100]) == pytest.approx(44.869632e-6, rel=1e-12)
    # TP 2 over the file's own 100 GB/s link: two all-reduces per layer of 1 token × 1024 × 2 B,
    # ring 2·(2−1)/2 · 2048 B / 100 GB/s = 20.48 ns each, ×4
    m2 = AnalyticModel(_toy_model(), _write(tmp_path, GOOD), tp=2)
    assert m2.breakdown([], [100])["allreduce"] == pytest.approx(4 * 20.48e-9, rel=1e-12)
    # per-step, per-layer and per-sequence overheads add exactly
    m3 = AnalyticModel(_toy_model(), _write(tmp_path, GOOD), step_overhead_s=1e-3,
                       layer_overhead_s=1e-5, seq_overhead_s=1e-4)
    assert m3.step_time([], [100, 100]) - m.step_time([], [100, 100]) == \
        pytest.approx(1e-3 + 2 * 1e-5 + 2 * 1e-4, rel=1e-9)


def test_moe_roofline_by_hand(tmp_path):
    """8 experts of width 512, top-2, both layers sparse. One decoded token reads exactly its 2
    experts (E·(1 − (1 − k/E)^1) = k); a long prefill touches all 8."""
    dense = _toy_model()
    moe = _toy_model(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512)
    spec = _write(tmp_path, GOOD)
    d, m = AnalyticModel(dense, spec), AnalyticModel(moe, spec)
    expert = 3 * 1024 * 512
    router_act = 1024 + 8  # router: hidden in, 8 logits out
    # linear part loses the dense MLP (3·1024·2048 weights) and gains the router (1024·8)
    lin_moe = m.breakdown([], [100])["linear"]
    lin_dense = d.breakdown([], [100])["linear"]
    delta_bytes = 2 * 2 * (1024 * 8 - 3 * 1024 * 2048 + router_act - (1024 + 4096 + 2048 + 1024))
    assert lin_moe - lin_dense == pytest.approx(delta_bytes / 1e12, rel=1e-9)
    moe_part = m.breakdown([], [100])["moe"]
    assert moe_part == pytest.approx(2 * 2 * (2 * expert + 2 * (2 * 1024 + 3 * 512)) / 1e12,
                                     rel=1e-9)
    big = m._experts(4096)
    assert big == (4096 * 2, pytest.approx(8.0))
    with pytest.raises(ValueError, match="ep=2 must be >= 1 and divide tp=1"):
        AnalyticModel(moe, spec, ep=2)
    with pytest.raises(ValueError, match="needs a mixture-of-experts"):
        AnalyticModel(dense, spec, tp=2, ep=2)
    # expert parallelism: the busiest of 2 GPUs takes more than half the token-expert pairs
    ep = AnalyticModel(moe, spec, tp=2, ep=2)
    pairs, touched = ep._experts(64)
    assert 64 < pairs < 128 and touched == pytest.approx(4 * (1 - 0.75**64))


def test_no_import_cycle_between_latency_and_analytic():
    """analytic.py imports latency.py; latency.py imports neither analytic.py nor anything that
    does, and has no lazy ``__getattr__`` shim (issue 9)."""
    import ast

    import pdserve.sim.latency as latency

    tree = ast.parse(Path(latency.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any("analytic" in (m or "") or m == "pdserve.sim" for m in imported), imported
    assert not any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__"
                   for n in tree.body)
    for first in ("pdserve.sim.analytic", "pdserve.sim.latency", "pdserve.sim.calibrate"):
        subprocess.run([sys.executable, "-c", f"import {first}"], check=True)


def test_catalogue_name_wins_over_a_same_named_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h100").write_text("not a spec")
    assert load_hardware("h100").device is get_device("H100")
    (tmp_path / "mygpu").write_text(GOOD)
    assert load_hardware("mygpu").device.name == "toy"  # a file without an extension
