"""Sabotage: a build with one deliberately wrong seam (meson option `sabotage`, test
builds only) must make the lanes that guard that seam fail, proving they can fail.
Each variant rebuilds the package into a temporary directory (about a minute)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")

# variant -> pytest arguments selecting lanes that must fail
VARIANTS = {
    "conv_reversed": ["test_profile.py::test_profile_digest[mamba1-cpu]",
                      "test_oracle.py", "-k", "mamba1"],
    "unfused_h": ["test_profile.py::test_profile_digest[mamba1-cpu]"],
    "chunk128": ["test_profile.py::test_profile_digest[mamba2-cpu]",
                 "test_mamba2.py::test_matches_spec_run_literally"],
    "segsum_descending": ["test_profile.py::test_profile_digest[mamba2-cpu]",
                          "test_mamba2.py::test_matches_spec_run_literally"],
    # the digest run decays every state to +0 within a chunk, so exp(..) * h_prev
    # is 0 there and only a fold of a live state (the spec lane) sees the rounding
    "unfused_state": ["test_mamba2.py::test_matches_spec_run_literally"],
    # reducing the angles once per call segment instead of every token moves bits
    # wherever a split or decode puts a segment end: the identity lanes see it
    "angle_per_chunk": ["test_identity.py", "-k",
                        "mamba3-cpu and (decode_equals_prefill or split_prefill)"],
    "no_shift": ["test_oracle.py::test_forward_matches_float64_oracle[mamba3-(3, 257, 64)]",
                 "test_mamba3.py::test_matches_spec_run_literally",
                 "test_mamba3.py::test_set_input_states_matches_reference",
                 "test_mamba3.py::test_A_floor_binds"],
    "chunk32": ["test_profile.py::test_profile_digest[mamba3-cpu]",
                "test_mamba3.py::test_matches_spec_run_literally"],
}

pytestmark = pytest.mark.slow

# Run pytest on the sabotaged build: put it first on sys.path and drop a
# meson-python editable finder (a developer install) that would shadow it.
RUNNER = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "MesonpyMetaFinder"]
sys.path.insert(0, sys.argv[1])
import mamba, pytest
assert mamba.__file__.startswith(sys.argv[1]), mamba.__file__
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider"] + sys.argv[2:]))
"""


def _build(variant, tmp):
    target = os.path.join(tmp, "site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
           "--target", target, f"-Csetup-args=-Dsabotage={variant}",
           "-Csetup-args=-Dhip=disabled",  # a sabotage is in C; the AMD kernels are not at stake
           f"-Cbuild-dir={os.path.join(tmp, 'build')}", ROOT]
    subprocess.run(cmd, check=True, capture_output=True)
    return target


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sabotaged_seam_fails_its_lanes(variant, tmp_path):
    target = _build(variant, str(tmp_path))
    res = subprocess.run([sys.executable, "-c", RUNNER, target] + VARIANTS[variant],
                         cwd=TESTS, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    # every selected lane fails, none passes
    assert res.returncode == 1 and " failed" in res.stdout and " passed" not in res.stdout, (
        f"sabotage {variant} did not make its lanes fail\n{res.stdout[-3000:]}{res.stderr[-2000:]}")
