"""`python -m mamba` subcommands, each run in a subprocess outside the source checkout
(where the uninstalled package would shadow the installed one): output and exit codes,
including a forced divergence that `check` must report. Numpy-free."""
import struct
import subprocess
import sys

import pytest

import mamba
from mamba import _lanes

# the float64 lane needs numpy
ORACLE_MISSING = _lanes._load_oracle("mamba1")[1]
LANES = ["repeat", "batch composition", "batch negative control", "decode == prefill",
         "split prefill == one prefill", "session == step", "ragged == rows alone",
         "lowbit bfloat16 == expanded", "lowbit int8 == expanded", "float64 oracle"]


def cli(tmp_path, *args, code=None):
    """Run `python -m mamba args` (or `python -c code`) in tmp_path."""
    cmd = [sys.executable] + (["-c", code] if code else ["-m", "mamba", *args])
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)


def rows_of(out):
    """{(backend, block, lane): [result, bits equal, max ulp, rel err]} of a check table."""
    table = {}
    for line in out.splitlines():
        for lane in LANES + ["== C reference", "all"]:
            parts = line.split(None, 2)
            if len(parts) == 3 and parts[2].startswith(lane + "  "):
                rest = parts[2][len(lane):].split()
                table[(parts[0], parts[1], lane)] = rest[:4]
    return table


def test_info_lists_every_backend(tmp_path):
    r = cli(tmp_path, "info")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["cpu", "cuda", "hip", "cpu"]
    assert lines[0].startswith("cpu   usable")
    for name, (ok, why) in mamba.backends().items():
        assert f"{name:5s} {'usable' if ok else 'unusable'}: {why}" in lines
    from mamba import _core
    isa = ["baseline", "x86-64-v3", "x86-64-v4"][_core._isa(-1)]
    assert lines[3].startswith(f"cpu ISA: {isa}")  # the copy of the hot loops in use


def test_check_runs_every_lane_on_every_block(tmp_path):
    r = cli(tmp_path, "check")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    table = rows_of(r.stdout)
    for name in _lanes.block_names():
        for lane in LANES:
            status, equal, ulp, rel = table[("cpu", name, lane)]
            if lane == "float64 oracle":
                assert status == ("n/a" if ORACLE_MISSING else "ok")
                assert rel == "-" if ORACLE_MISSING else float(rel) <= 1e-5
            elif lane == "batch negative control":
                assert status == "ok"
            else:
                assert (status, equal, ulp) == ("ok", "yes", "0"), (name, lane)
    for be in [n for n in _lanes.usable_backends() if n != "cpu"]:
        assert any(k[0] == be for k in table), f"{be} is usable but was not checked"
    assert " 0 failed" in r.stdout
    assert "checking cpu mamba1: repeat" in r.stderr, "progress goes to stderr"


@pytest.mark.parametrize("lane", ["repeat", "decode == prefill", "lowbit int8 == expanded"])
def test_check_exits_non_zero_on_a_divergence(tmp_path, lane):
    code = ("import sys; from mamba import _lanes, cli; "
            f"_lanes._FAULT = {lane!r}; "
            "sys.exit(cli.main(['check', '--backend', 'cpu', '--block', 'mamba1']))")
    r = cli(tmp_path, code=code)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    table = rows_of(r.stdout)
    assert table[("cpu", "mamba1", lane)][:3] == ["FAIL", "NO", "1"]
    others = [k for k, v in table.items() if v[0] == "FAIL"]
    assert others == [("cpu", "mamba1", lane)]
    assert " 1 failed" in r.stdout


@pytest.mark.skipif(bool(ORACLE_MISSING), reason=ORACLE_MISSING)
def test_check_oracle_lane_can_fail(tmp_path):
    # a tolerance no float32 evaluation can meet
    code = ("import sys; from mamba import _lanes, cli; "
            "_lanes.RTOL, _lanes.ATOL = 1e-9, 1e-15; "
            "sys.exit(cli.main(['check', '--backend', 'cpu', '--block', 'mamba1']))")
    r = cli(tmp_path, code=code)
    assert r.returncode == 1
    assert rows_of(r.stdout)[("cpu", "mamba1", "float64 oracle")][0] == "FAIL"


def test_check_without_numpy_says_so(tmp_path):
    code = ("import sys; sys.modules['numpy'] = None; from mamba import cli; "
            "sys.exit(cli.main(['check', '--backend', 'cpu', '--block', 'mamba1']))")
    r = cli(tmp_path, code=code)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert rows_of(r.stdout)[("cpu", "mamba1", "float64 oracle")] == ["n/a", "-", "-", "-"]
    assert "numpy not importable" in r.stdout


def test_check_refuses_an_unusable_backend(tmp_path):
    unusable = [n for n, (ok, _) in mamba.backends().items() if not ok]
    if not unusable:
        pytest.skip("every backend is usable here")
    r = cli(tmp_path, "check", "--backend", unusable[0])
    assert r.returncode == 2
    assert f"backend {unusable[0]!r} was requested but is not usable" in r.stderr
    assert r.stdout == ""


def test_bench_times_forward_and_decode(tmp_path):
    r = cli(tmp_path, "bench", "--block", "mamba1", "--d-model", "32", "--length", "16",
            "--repeat", "2", "--tokens", "3", "--backend", "cpu")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "Mamba1Block (d_model 32, B 1, L 16" in out and "backend  cpu" in out
    for phase in ("forward", "decode (session step)"):
        line = next(ln for ln in out.splitlines() if ln.startswith(phase + " "))
        ms, tps = line[len(phase):].split()
        assert float(ms) > 0 and float(tps) > 0
    assert ("backward: not available" in out) != any(
        ln.startswith("backward ") for ln in out.splitlines())
    assert "forward 1/2" in r.stderr and "decode 1/3" in r.stderr


def test_run_still_default(tmp_path):
    r = cli(tmp_path, "--d-model", "32", "--length", "8")
    assert r.returncode == 0, r.stderr
    assert "decode == prefill bit for bit: yes" in r.stdout


def f32(*vals):
    return struct.pack(f"<{len(vals)}f", *vals)


def test_compare_counts_ulps_and_treats_nans_alike():
    one_up = struct.unpack("<f", struct.pack("<I", 0x3f800003))[0]
    assert _lanes.compare(f32(1.0, 2.0), f32(1.0, 2.0)) == (True, 0)
    assert _lanes.compare(f32(1.0, 2.0), f32(one_up, 2.0)) == (False, 3)
    # across zero: -min_subnormal to +min_subnormal is two steps
    tiny = struct.unpack("<f", struct.pack("<I", 1))[0]
    assert _lanes.compare(f32(-tiny), f32(tiny)) == (False, 2)
    assert _lanes.compare(f32(0.0), f32(-0.0)) == (False, 0)
    qnan = struct.pack("<I", 0x7fc00000)
    other_nan = struct.pack("<I", 0xffc00001)
    assert _lanes.compare(qnan + f32(1.0), other_nan + f32(1.0)) == (True, 0)
    assert _lanes.compare(qnan, f32(1.0)) == (False, float("inf"))
    assert _lanes.compare(f32(1.0), f32(1.0, 1.0)) == (False, None)


def test_a_crashing_lane_is_a_failure_and_the_others_still_run(monkeypatch):
    def boom(ctx, blk, s, name, backend):
        raise RuntimeError("boom")
    monkeypatch.setattr(_lanes, "_LANES", [("repeat", boom), ("decode == prefill",
                                                               _lanes._lane_decode)])
    res = _lanes.run(["cpu"], ["mamba1"])
    assert [(r.lane, r.status, r.note) for r in res] == [
        ("repeat", "FAIL", "RuntimeError: boom"),
        ("decode == prefill", "ok", "prefill 5, steps to 14")]
